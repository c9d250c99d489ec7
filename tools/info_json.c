/* dpsync-info: a small JSON reader, enough for dpsync's describe output. */
#define _GNU_SOURCE
#include "dpsync_info.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
  const char *p;
  int ok;
} json_reader;

static void skip_ws(json_reader *r) {
  while (*r->p && isspace((unsigned char)*r->p)) r->p++;
}

static char *parse_string(json_reader *r) {
  size_t cap = 16, len = 0;
  char *s = malloc(cap);
  if (!s) exit(1);
  r->p++; /* opening quote */
  while (*r->p && *r->p != '"') {
    char c = *r->p++;
    if (c == '\\') {
      c = *r->p++;
      switch (c) {
        case 'n': c = '\n'; break;
        case 't': c = '\t'; break;
        case 'r': c = '\r'; break;
        case 'b': c = '\b'; break;
        case 'f': c = '\f'; break;
        case 'u': {
          /* dpsync writes \u only for control characters: keep one byte, '?' otherwise. */
          unsigned v = 0;
          for (int i = 0; i < 4 && isxdigit((unsigned char)*r->p); i++, r->p++)
            v = v * 16 + (unsigned)(isdigit((unsigned char)*r->p) ? *r->p - '0'
                                                                  : (tolower(*r->p) - 'a' + 10));
          c = v < 0x80 ? (char)v : '?';
          break;
        }
        case '\0': r->ok = 0; r->p--; c = 0; break;
        default: break; /* \" \\ \/ */
      }
    }
    if (len + 2 > cap) {
      cap *= 2;
      s = realloc(s, cap);
      if (!s) exit(1);
    }
    s[len++] = c;
  }
  if (*r->p == '"') r->p++;
  else r->ok = 0;
  s[len] = '\0';
  return s;
}

static void parse_value(json_reader *r, json *out);

static void push(json *v, json *item, char *key) {
  v->items = realloc(v->items, (v->n + 1) * sizeof *v->items);
  if (!v->items) exit(1);
  v->items[v->n] = *item;
  if (v->type == J_OBJ) {
    v->keys = realloc(v->keys, (v->n + 1) * sizeof *v->keys);
    if (!v->keys) exit(1);
    v->keys[v->n] = key;
  }
  v->n++;
}

static void parse_container(json_reader *r, json *out, json_type type, char close) {
  out->type = type;
  r->p++;
  skip_ws(r);
  if (*r->p == close) {
    r->p++;
    return;
  }
  while (r->ok) {
    char *key = NULL;
    if (type == J_OBJ) {
      skip_ws(r);
      if (*r->p != '"') break;
      key = parse_string(r);
      skip_ws(r);
      if (*r->p != ':') {
        free(key);
        break;
      }
      r->p++;
    }
    json item = {0};
    parse_value(r, &item);
    push(out, &item, key);
    skip_ws(r);
    if (*r->p == ',') {
      r->p++;
      continue;
    }
    if (*r->p == close) {
      r->p++;
      return;
    }
    break;
  }
  r->ok = 0;
}

static void parse_value(json_reader *r, json *out) {
  skip_ws(r);
  memset(out, 0, sizeof *out);
  char c = *r->p;
  if (c == '{') {
    parse_container(r, out, J_OBJ, '}');
  } else if (c == '[') {
    parse_container(r, out, J_ARR, ']');
  } else if (c == '"') {
    out->type = J_STR;
    out->str = parse_string(r);
  } else if (strncmp(r->p, "true", 4) == 0 || strncmp(r->p, "false", 5) == 0) {
    out->type = J_BOOL;
    out->num = c == 't';
    r->p += c == 't' ? 4 : 5;
  } else if (strncmp(r->p, "null", 4) == 0) {
    out->type = J_NULL;
    r->p += 4;
  } else {
    char *end = NULL;
    out->type = J_NUM;
    out->num = strtod(r->p, &end);
    if (end == r->p) r->ok = 0;
    else r->p = end;
  }
}

void json_free(json *v) {
  for (size_t i = 0; i < v->n; i++) {
    json_free(&v->items[i]);
    if (v->keys) free(v->keys[i]);
  }
  free(v->items);
  free(v->keys);
  free(v->str);
}

int json_parse(const char *text, json *out) {
  json_reader r = {text, 1};
  parse_value(&r, out);
  skip_ws(&r);
  if (!r.ok || *r.p) {
    json_free(out);
    return 0;
  }
  return 1;
}

const json *get(const json *obj, const char *key) {
  if (!obj || obj->type != J_OBJ) return NULL;
  for (size_t i = 0; i < obj->n; i++)
    if (strcmp(obj->keys[i], key) == 0) return &obj->items[i];
  return NULL;
}

const char *str_of(const json *v) { return v && v->type == J_STR ? v->str : ""; }

/* Writes a value compactly on one line: strings bare, lists in brackets. */
void print_compact(const json *v) {
  if (!v) return;
  switch (v->type) {
    case J_NULL: printf("null"); break;
    case J_BOOL: printf(v->num ? "true" : "false"); break;
    case J_NUM: printf("%.10g", v->num); break;
    case J_STR: printf("%s", v->str); break;
    case J_ARR:
      printf("[");
      for (size_t i = 0; i < v->n; i++) {
        if (i) printf(", ");
        print_compact(&v->items[i]);
      }
      printf("]");
      break;
    case J_OBJ:
      printf("{");
      for (size_t i = 0; i < v->n; i++) {
        printf(i ? ", %s: " : "%s: ", v->keys[i]);
        print_compact(&v->items[i]);
      }
      printf("}");
      break;
  }
}

/* Writes `s` as a JSON string literal. */
void put_json_string(const char *s) {
  putchar('"');
  for (const unsigned char *p = (const unsigned char *)(s ? s : ""); *p; p++) {
    if (*p == '"' || *p == '\\') printf("\\%c", *p);
    else if (*p < 0x20) printf("\\u%04x", *p);
    else putchar(*p);
  }
  putchar('"');
}
