#!/usr/bin/env python3
"""Check that the generated include/dpsync.h provides the C contract (shared/api/dpsync.h and its
addenda shared/api/dpsync_world.h, dpsync_shard.h, dpsync_repro.h and dpsync_elastic.h).

The contract header is parsed for function prototypes, enum constants and typedefs. A C file is
generated that includes the project's header and, for each of them,

    static <ret> (*const check_<name>)(<params>) = <name>;    /* same signature */
    _Static_assert(<CONST> == <value>, "<CONST>");          /* same value */
    typedef <type> check_type_<type>;                        /* type exists */

and compiled with `cc -std=c11 -Wall -Wextra -Wpedantic -Werror -c`. A mismatch in any parameter
or return type is an incompatible-pointer error. When the whole file fails, each item is compiled
on its own to name the ones at fault.

    python3 tests/contract/check_contract.py [CONTRACT_HEADER...] [--header include/dpsync.h] [--cc cc]

Standard library only. Exits 0 with "skipped: ..." when the contract header is not present.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

# Declared by the contract but not exported by the library yet (see the project's spec). They are
# checked anyway as soon as the generated header declares them. Empty: every function is exported.
NOT_YET_EXPORTED = set()

CFLAGS = ["-std=c11", "-Wall", "-Wextra", "-Wpedantic", "-Werror"]


# ---------------------------------------------------------------------------- parsing


def strip_comments_and_preprocessor(text):
    """Remove comments (keeping string literals intact) and preprocessor lines."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("/*", i):
            end = text.find("*/", i + 2)
            end = n if end < 0 else end + 2
            out.append(" " if "\n" not in text[i:end] else "\n")
            i = end
        elif text.startswith("//", i):
            end = text.find("\n", i)
            i = n if end < 0 else end
        elif c == '"' or c == "'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(text[i : j + 1])
            i = j + 1
        else:
            out.append(c)
            i += 1
    lines = []
    continued = False
    for line in "".join(out).split("\n"):
        is_directive = continued or line.lstrip().startswith("#")
        continued = is_directive and line.rstrip().endswith("\\")
        if not is_directive:
            lines.append(line)
    return "\n".join(lines)


def top_level_statements(text):
    """Split into ';'-terminated statements at brace depth 0, ignoring `extern "C" {` wrappers."""
    text = re.sub(r'extern\s+"C"\s*\{', " ", text)
    stmts, cur, depth = [], [], 0
    for c in text:
        if c == "{":
            depth += 1
        elif c == "}":
            if depth == 0:  # the closing brace of an `extern "C" {` block
                continue
            depth -= 1
        if c == ";" and depth == 0:
            stmt = " ".join("".join(cur).split())
            if stmt:
                stmts.append(stmt)
            cur = []
        else:
            cur.append(c)
    return stmts


def parse_int(expr):
    try:
        return int(expr.rstrip("uUlL"), 0)
    except ValueError:
        return None


def parse_enum_body(body, constants):
    """Append (name, value) pairs; implicit values continue from the previous one."""
    nxt = 0
    for item in body.split(","):
        item = item.strip()
        if not item:
            continue
        if "=" in item:
            name, expr = (s.strip() for s in item.split("=", 1))
            value = parse_int(expr)
            constants.append((name, value if value is not None else "(" + expr + ")"))
            nxt = value + 1 if value is not None else None
        else:
            constants.append((item, nxt if nxt is not None else None))
            nxt = nxt + 1 if nxt is not None else None


FUNC_RE = re.compile(r"^(?P<ret>.*?[\w\*\s])\b(?P<name>[A-Za-z_]\w*)\s*\((?P<params>.*)\)$")


def parse_header(path):
    """Return dict(functions=[(ret, name, params)], constants=[(name, value)],
    typedefs=[(name, kind, tag)]) where kind is 'enum', 'struct' or 'other'."""
    with open(path, encoding="utf-8") as f:
        text = strip_comments_and_preprocessor(f.read())
    functions, constants, typedefs = [], [], []
    for stmt in top_level_statements(text):
        m = re.match(r"^(typedef\s+)?enum\s*(\w+)?\s*\{(.*)\}\s*(\w+)?$", stmt)
        if m:
            parse_enum_body(m.group(3), constants)
            if m.group(1) and m.group(4):
                typedefs.append((m.group(4), "enum", m.group(2)))
            continue
        m = re.match(r"^typedef\s+(struct|union)\s+(\w+)\s+(\w+)$", stmt)
        if m:
            typedefs.append((m.group(3), m.group(1), m.group(2)))
            continue
        if stmt.startswith("typedef "):
            m = re.search(r"(\w+)\s*(\[[^\]]*\])?$", stmt)
            if m and "(" not in stmt:
                typedefs.append((m.group(1), "other", None))
            continue
        m = FUNC_RE.match(stmt)
        if m and "{" not in stmt:
            ret = " ".join(m.group("ret").split())
            if ret.startswith("extern "):
                ret = ret[len("extern ") :]
            functions.append((ret, m.group("name"), " ".join(m.group("params").split())))
    return {"functions": functions, "constants": constants, "typedefs": typedefs}


def declared_identifiers(path):
    """Identifiers of the generated header, for 'is it declared at all' checks."""
    with open(path, encoding="utf-8") as f:
        text = strip_comments_and_preprocessor(f.read())
    return set(re.findall(r"[A-Za-z_]\w*", text))


# ---------------------------------------------------------------------------- checks


def make_items(contract, present):
    """One (label, file_scope_code, use_code) per check; skipped function names separately."""
    items, skipped = [], []
    for ret, name, params in contract["functions"]:
        if name in NOT_YET_EXPORTED and name not in present:
            skipped.append(name)
            continue
        items.append(
            (
                "function " + name,
                "static %s (*const check_%s)(%s) = %s;\n" % (ret, name, params or "void", name),
                "  (void)check_%s;\n" % name,
            )
        )
    for name, value in contract["constants"]:
        if value is None:
            continue
        items.append(("constant " + name, '_Static_assert(%s == %s, "%s");\n' % (name, value, name), ""))
    for name, kind, tag in contract["typedefs"]:
        decl = "typedef %s check_type_%s;\n" % (name, name)
        use = ""
        if kind == "enum" and tag:
            # ISO C has no forward-declared enums: this fails unless the tag exists.
            decl += "typedef enum %s check_tag_%s;\n" % (tag, name)
        elif kind in ("struct", "union") and tag:
            # The typedef must name this tag: otherwise the pointer conversion is incompatible.
            use = "  { %s *a = 0; %s %s *b = a; (void)b; }\n" % (name, kind, tag)
        items.append(("type " + name, decl, use))
    return items, skipped


def render(items):
    src = ["/* generated by tests/contract/check_contract.py */\n", "#include <dpsync.h>\n\n"]
    src += [decl for _, decl, _ in items]
    src.append("\nvoid dpsync_contract_use(void);\nvoid dpsync_contract_use(void) {\n")
    src += [use for _, _, use in items]
    src.append("}\n")
    return "".join(src)


def compile_c(cc, include_dir, source, workdir, stem):
    c_path = os.path.join(workdir, stem + ".c")
    with open(c_path, "w", encoding="utf-8") as f:
        f.write(source)
    cmd = [cc] + CFLAGS + ["-I", include_dir, "-c", c_path, "-o", os.path.join(workdir, stem + ".o")]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True)
    return proc.returncode == 0, proc.stdout, c_path


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    api = os.path.join(REPO_ROOT, "..", "shared", "api")
    ap.add_argument("contract", nargs="*",
                    default=[os.path.join(api, h) for h in ("dpsync.h", "dpsync_world.h",
                                                             "dpsync_shard.h", "dpsync_repro.h",
                                                             "dpsync_elastic.h")],
                    help="contract headers (default: ../shared/api/dpsync.h, dpsync_world.h, "
                         "dpsync_shard.h, dpsync_repro.h and dpsync_elastic.h next to the "
                         "repository)")
    ap.add_argument("--header", default=os.path.join(REPO_ROOT, "include", "dpsync.h"),
                    help="the generated header (default: include/dpsync.h)")
    ap.add_argument("--cc", default=os.environ.get("CC", "cc"), help="C compiler (default: $CC or cc)")
    ap.add_argument("--keep", action="store_true", help="keep the generated C file and print its path")
    args = ap.parse_args()

    contract_paths = [os.path.abspath(c) for c in args.contract]
    header_path = os.path.abspath(args.header)
    for contract_path in contract_paths:
        if not os.path.isfile(contract_path):
            print("skipped: contract header not found at %s" % contract_path)
            return 0
    if not os.path.isfile(header_path):
        print("error: generated header not found at %s (run cargo build --release first)" % header_path)
        print("0 passed, 1 failed")
        return 1
    if shutil.which(args.cc) is None:
        print("skipped: C compiler %r not found" % args.cc)
        return 0

    contract = parse_header(contract_paths[0])
    for extra in contract_paths[1:]:
        more = parse_header(extra)
        if not more["functions"]:
            print("error: parsed no functions from %s" % extra)
            print("0 passed, 1 failed")
            return 1
        for key, value in more.items():
            if isinstance(value, dict):
                contract[key].update(value)
            else:
                contract[key] = contract[key] + [v for v in value if v not in contract[key]]
    if not contract["functions"] or not contract["constants"]:
        print("error: parsed no functions or no constants from %s" % ", ".join(contract_paths))
        print("0 passed, 1 failed")
        return 1
    present = declared_identifiers(header_path)
    items, skipped = make_items(contract, present)
    n_functions = sum(1 for label, _, _ in items if label.startswith("function "))
    n_constants = sum(1 for label, _, _ in items if label.startswith("constant "))
    n_types = len(items) - n_functions - n_constants

    print("contract:  %s" % ", ".join(contract_paths))
    print("generated: %s" % header_path)
    if skipped:
        print("not exported yet (allowed): %s" % ", ".join(skipped))
    missing = [label for label, _, _ in items if label.split(" ", 1)[1] not in present]
    if missing:
        print("not declared in the generated header: %s" % ", ".join(missing))

    workdir = tempfile.mkdtemp(prefix="dpsync_contract_")
    try:
        include_dir = os.path.dirname(header_path)
        ok, output, c_path = compile_c(args.cc, include_dir, render(items), workdir, "contract_check")
        if ok:
            print("contract check: %d functions, %d constants: ok (and %d types)" % (n_functions, n_constants, n_types))
            print("%d passed, 0 failed" % len(items))
            return 0
        print("compiling the contract check failed:")
        print(output.rstrip())
        # Compile each item alone so the report names every declaration at fault.
        failed = []
        for i, item in enumerate(items):
            item_ok, item_out, _ = compile_c(args.cc, include_dir, render([item]), workdir, "item%d" % i)
            if not item_ok:
                failed.append(item[0])
        if failed:
            print("mismatches with the contract:")
            for label in failed:
                print("  FAIL %s" % label)
            print("%d passed, %d failed" % (len(items) - len(failed), len(failed)))
        else:
            print("every item compiles on its own, but not all together")
            print("%d passed, 1 failed" % len(items))
        return 1
    finally:
        if args.keep:
            print("generated C file kept in %s" % workdir)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
