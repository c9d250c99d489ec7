// Proves include/dpsync.h compiles as C++17 with -Wall -Wextra -Wpedantic -Werror and links
// (the declarations must be wrapped in extern "C").
#include <dpsync.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

static_assert(DPSYNC_STATUS_PANIC == 9, "DPSYNC_STATUS_PANIC");
static_assert(DPSYNC_TRANSPORT_HOST == 3, "DPSYNC_TRANSPORT_HOST");

namespace {
struct OptionsDeleter {
  void operator()(dpsync_options *o) const { dpsync_options_free(o); }
};
struct ContextDeleter {
  void operator()(dpsync_context *c) const { dpsync_context_destroy(c); }
};
}  // namespace

int main() {
  std::printf("dpsync version %s (C++17)\n", dpsync_version());

  dpsync_options *raw_opts = nullptr;
  if (dpsync_options_new(&raw_opts) != DPSYNC_STATUS_OK) return 1;
  std::unique_ptr<dpsync_options, OptionsDeleter> opts(raw_opts);
  if (dpsync_options_set_host_replicas(opts.get(), 2) != DPSYNC_STATUS_OK) return 1;

  dpsync_context *raw_ctx = nullptr;
  if (dpsync_context_create(opts.get(), &raw_ctx) != DPSYNC_STATUS_OK) return 1;
  std::unique_ptr<dpsync_context, ContextDeleter> ctx(raw_ctx);

  std::vector<double> g0{1.0, 2.0}, g1{3.0, 4.0};
  if (dpsync_register(ctx.get(), "g", DPSYNC_ROLE_GRAD, 0, g0.data(), g0.size(), DPSYNC_DTYPE_F64) != DPSYNC_STATUS_OK ||
      dpsync_register(ctx.get(), "g", DPSYNC_ROLE_GRAD, 1, g1.data(), g1.size(), DPSYNC_DTYPE_F64) != DPSYNC_STATUS_OK ||
      dpsync_allreduce_grads(ctx.get(), DPSYNC_REDUCE_SUM) != DPSYNC_STATUS_OK) {
    std::fprintf(stderr, "failed: %s\n", dpsync_last_error());
    return 1;
  }
  std::size_t length = 0;
  if (dpsync_describe(ctx.get(), nullptr, 0, &length) != DPSYNC_STATUS_OK) return 1;
  std::string json(length + 1, '\0');
  if (dpsync_describe(ctx.get(), json.data(), json.size(), &length) != DPSYNC_STATUS_OK) return 1;
  json.resize(length);

  dpsync_status st = dpsync_allreduce(ctx.get(), "missing", DPSYNC_REDUCE_SUM);
  std::printf("%s: %s\n", dpsync_status_name(st), dpsync_last_error());
  bool ok = g0 == std::vector<double>{4.0, 6.0} && g1 == g0 && st == DPSYNC_STATUS_NOT_FOUND && !json.empty();
  return ok ? 0 : 1;
}
