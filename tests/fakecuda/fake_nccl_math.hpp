// The fake NCCL's arithmetic (fake_nccl.cpp includes it inside its anonymous namespace): the
// element types it computes in, and one reduction of sources in a given order.

float half_to_float(uint16_t h) {
  int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  float f = e == 0 ? std::ldexp(float(m), -24)
                   : e == 31 ? (m ? NAN : INFINITY) : std::ldexp(float(m | 0x400), e - 25);
  return h & 0x8000 ? -f : f;
}
// Round to nearest even (nearbyint in the default rounding mode); float holds every sum of two
// halves or bfloat16s exactly enough (24 >= 2*11+2 bits) that this double rounding is exact.
uint16_t float_to_half(float f) {
  uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  float a = std::fabs(f);
  if (std::isnan(f)) return sign | 0x7e00;
  if (a >= 65520.0f) return sign | 0x7c00;                                  // rounds to infinity
  if (a < 0x1p-14f) return sign | uint16_t(std::nearbyint(a * 0x1p24f));  // subnormal
  int e;
  float q = std::nearbyint(std::ldexp(std::frexp(a, &e), 11));  // 1024..2048; 2048 carries
  return sign | uint16_t(((e + 14) << 10) + int(q) - 1024);
}
float bf16_to_float(uint16_t h) {
  uint32_t x = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}
uint16_t float_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if (std::isnan(f)) return uint16_t(x >> 16) | 0x40;
  return uint16_t((x + 0x7fff + ((x >> 16) & 1)) >> 16);
}

// An element type: C is what it computes in; round() is the store-and-reload of each step.
template <class T> struct Native {
  using C = T;
  static C load(const void* p, size_t i) { return static_cast<const T*>(p)[i]; }
  static void store(void* p, size_t i, C v) { static_cast<T*>(p)[i] = v; }
  static C round(C v) { return v; }
};
template <float (*From)(uint16_t), uint16_t (*To)(float)> struct Short {
  using C = float;
  static C load(const void* p, size_t i) { return From(static_cast<const uint16_t*>(p)[i]); }
  static void store(void* p, size_t i, C v) { static_cast<uint16_t*>(p)[i] = To(v); }
  static C round(C v) { return From(To(v)); }
};

template <class C> C combine(int op, C a, C b) {
  if constexpr (std::is_integral_v<C>) {  // integers wrap, as on the GPU
    using U = std::make_unsigned_t<C>;
    if (op == 0 || op == 4) return C(U(a) + U(b));
    if (op == 1) return C(U(a) * U(b));
  } else {
    if (op == 0 || op == 4) return a + b;
    if (op == 1) return a * b;
  }
  return op == 2 ? std::max(a, b) : std::min(a, b);
}

// Reduces the sources in the order given (rank 0, 1, .. n-1 for an allreduce; a reduce-scatter
// gives the ring's) into a temporary, then writes every output (so send == recv works).
template <class T>
void reduce(const std::vector<const void*>& srcs, const std::vector<void*>& outs, size_t count,
            int op) {
  std::vector<typename T::C> acc(count);
  for (size_t i = 0; i < count; i++) acc[i] = T::load(srcs[0], i);
  for (size_t r = 1; r < srcs.size(); r++)
    for (size_t i = 0; i < count; i++) acc[i] = T::round(combine(op, acc[i], T::load(srcs[r], i)));
  if (op == 4)
    for (auto& v : acc) v = T::round(v / typename T::C(srcs.size()));
  for (void* out : outs)
    for (size_t i = 0; i < count; i++) T::store(out, i, acc[i]);
}

void allreduce(int dtype, const std::vector<const void*>& srcs, const std::vector<void*>& outs,
               size_t count, int op) {
  switch (dtype) {
    case 0: return reduce<Native<int8_t>>(srcs, outs, count, op);
    case 1: return reduce<Native<uint8_t>>(srcs, outs, count, op);
    case 2: return reduce<Native<int32_t>>(srcs, outs, count, op);
    case 3: return reduce<Native<uint32_t>>(srcs, outs, count, op);
    case 4: return reduce<Native<int64_t>>(srcs, outs, count, op);
    case 5: return reduce<Native<uint64_t>>(srcs, outs, count, op);
    case 6: return reduce<Short<half_to_float, float_to_half>>(srcs, outs, count, op);
    case 7: return reduce<Native<float>>(srcs, outs, count, op);
    case 8: return reduce<Native<double>>(srcs, outs, count, op);
    case 9: return reduce<Short<bf16_to_float, float_to_bf16>>(srcs, outs, count, op);
  }
}
