// casspec's own CPU ops (ops.cpp: a float32 forward's small steps; blockq.cpp: block-quantized products), shared
// by the C++ layer loop (layers.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace casspec {

constexpr int64_t kMaxHeadDim = 256;  // the widest attention head the ops take (16 chunks of 16 floats)
// The instruction sets the ops have paths for, each path the same bits as the others (ISA: -1 the widest this CPU
// runs). machine_isa(): that widest path (AVX-512: avx512f; AVX2: avx2 and fma), capped by the environment's
// CASSPEC_ISA (plain | avx2 | avx512) where it is set, so any machine can run the plain path (tests, CI).
enum Isa : int64_t { kAuto = -1, kPlain = 0, kAvx2 = 1, kAvx512 = 2 };
Isa machine_isa();
inline int64_t machine_isa_op() { return machine_isa(); }  // (torch.ops.casspec.machine_isa: the path in use)

constexpr int64_t kRowBlock = 16;  // query rows an attention task takes together (each key read once for them)
constexpr int64_t kByDimHeads = 12;  // an attention task of this many query rows x heads scores its keys
                                     // dimension-major (fold512.h; at 3 x 3 that was slower)
constexpr int64_t kPointwiseTask = 1 << 14;  // floats a thread's task of a row-wise op (norm, RoPE, silu) takes
constexpr int64_t kParallelWork = 1 << 18;  // an attention or a block product of more multiply-adds than this runs
                                            // on every thread (fewer: waking the other costs more)

// x rounded to bfloat16's precision, kept as a float32: the value a bfloat16 op's result holds (c10's rounding, the
// one torch casts with: to nearest, ties to even, integer operations, so the same bits in every instruction set's
// path)
inline float round_bf16(float x) { return c10::detail::f32_from_bits(c10::detail::round_to_nearest_even(x)); }

// Every op checks each tensor argument before it reads one: dtype, device, dims, the sizes it indexes and unit
// strides where it reads rows directly (an untrusted model file or a caller's mistake gives an error, never a read
// outside a tensor or a trap). `what` names the op and the argument in the error.
inline void check_tensor(const at::Tensor& t, const char* what, at::ScalarType dtype, int64_t dims) {
  TORCH_CHECK(t.defined(), "casspec ", what, ": a tensor is required");
  TORCH_CHECK(t.scalar_type() == dtype, "casspec ", what, ": ", c10::toString(dtype), " expected, got ",
              c10::toString(t.scalar_type()));
  TORCH_CHECK(t.device().is_cpu(), "casspec ", what, ": a CPU tensor expected, got one on ", t.device().str());
  TORCH_CHECK(t.dim() == dims, "casspec ", what, ": ", dims, " dims expected, got ", t.dim());
}

// The row-wise ops take float32 or bfloat16 (weights and tables in x's dtype); a bfloat16 op computes in float32 and
// rounds each result to bfloat16 where the bfloat16 ATen ops of dsia/model.py round it.
// RMSNorm of x [T, D] with weight [D]: [T, D]
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
// (x + delta, its RMSNorm), [T, D] each
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                                double eps);
// RoPE of x [heads, T, hd] with cos [T, hd] and the signed sin [T, hd]: [heads, T, hd], contiguous
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
// x [T, K] float32 times GGUF-style blocks as stored (blockq.cpp) of format `format` for n outputs: [T, n]
at::Tensor block_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t n,
                        int64_t format, int64_t isa);
// x [T, K] float32 or bfloat16 times w [N, K] in x's dtype (+ bias [N]) by casspec's own kernel (dense.cpp): [T, N],
// each row the same bits whatever the rows beside it and the instruction set (isa -1: the best this CPU has).
// dense_pack: w as the kernel reads it, panels [ceil(N / 64), K, 64] (made once per weight by its caller);
// dense_panels: the product with them; dense_linear: the same product of w as it is (packed for the call)
at::Tensor dense_pack(const at::Tensor& w);
// the k largest entries of each row of x [T, V] float32 (descending; of equal ones the lower index first; NaN read as
// -inf; rowtop.cpp): (values [T, k], indices [T, k] int64); row_top_lse also log(sum_j e^(scale x_j)) per row [T]
// (NaN where a NaN entry sits beside a number)
std::tuple<at::Tensor, at::Tensor> row_top(const at::Tensor& x, int64_t k);
std::tuple<at::Tensor, at::Tensor, at::Tensor> row_top_lse(const at::Tensor& x, int64_t k, double scale);
// standard Gumbel noise of (seed, position) at tokens [n] int64 in 0..vocab-1, or at every token (tokens absent):
// [n] or [vocab] float64, each value a pure function of (seed, position, token) (gumbel.cpp)
at::Tensor gumbel(int64_t seed, int64_t position, const std::optional<at::Tensor>& tokens, int64_t vocab);
// the same noise at tokens [n] into out [n], on this thread (tokens checked by the caller)
void gumbel_tokens(int64_t seed, int64_t position, const int64_t* tokens, int64_t n, double* out);
// coupled drafting's top k of each row of logits [T, V] float32 (coupled.cpp): (probs [T, k] float32, tokens [T, k]
// int64, inside [T] bool); see there
std::tuple<at::Tensor, at::Tensor, at::Tensor> coupled_top(const at::Tensor& logits, double temperature, int64_t top_k,
                                                           double top_p, int64_t seed, const at::Tensor& positions,
                                                           int64_t k, int64_t candidates);
constexpr int64_t kDenseGroup = 64;  // outputs a group of the panels (dense.cpp: an AVX-512 tile's 4 vectors)
// panels [ceil(N / 64), K, 64] of `dtype`, contiguous, on the CPU, as dense_pack makes them of a w [N, K], or an
// error naming `what`
void check_panels(const at::Tensor& panels, int64_t N, int64_t K, at::ScalarType dtype, const char* what);
at::Tensor dense_panels(const at::Tensor& x, const at::Tensor& panels, int64_t N,
                        const std::optional<at::Tensor>& bias, int64_t isa);
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                        int64_t isa);
// attention of q [H, T, hd] over keys, values [Hkv, S, hd] at slots [0, end): row t sees the slots where mask [T,
// end] is true, or (no mask) slots [0, end - T + t]; scores scaled by `scale`. Returns [T, H*hd].
at::Tensor attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, int64_t end,
                     const std::optional<at::Tensor>& mask, double scale);

// an attention's mask [T, end] as contiguous bools (undefined where there is none: causal by slot), checked: its
// shape, and that every row sees a key (`what` names the caller in the error)
at::Tensor visible_mask(const std::optional<at::Tensor>& mask, int64_t T, int64_t end, const char* what);

// gated MLP activation silu(gate) * up of gate, up [T, I] (rows of any stride): [T, I], each element as
// silu_mul_row computes it
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up);

// The kernels' loops over raw rows, for the one-region step (step.cpp): each computes its part of the same result
// as the op above it, the same bits, and checks nothing (the caller checked every size they index). bf16: the
// values are bfloat16's (held as float32) and each result is rounded as the op rounds a bfloat16 one.
namespace raw {
// one row: out = w * (x * 1 / sqrt(mean(x^2) + eps)), as rms_norm
void norm_row(const float* x, const float* w, float* out, int64_t D, double eps, bool bf16 = false);
// one row and head: out[j] = x[j] cos[j] + x[(j + hd/2) mod hd] sin[j] (sin signed), as rope
void rope_row(const float* x, const float* cos, const float* sin, float* out, int64_t hd, bool bf16 = false);
// n elements: silu(gate) * up, as silu_mul
void silu_mul_row(const float* gate, const float* up, float* out, int64_t n, bool bf16 = false);
// n elements: x += delta, as add_rms_norm's sum
void add_rows(float* x, const float* delta, int64_t n, bool bf16);
// n values rounded to bfloat16 in place (round_bf16), kept as float32
void round_bf16(float* x, int64_t n);
// query rows [r0, r1) of G heads (q + r * q_row + h * hd) attending over float32 keys, values (slot j at keys + j *
// kv_row) at slots [0, end) as mask [T, end] (or causal: row t at slot end - T + t) says: out + r * out_row + h * hd
void attend(const float* q, int64_t q_row, const float* keys, const float* values, int64_t kv_row, const bool* mask,
            int64_t T, int64_t end, int64_t r0, int64_t r1, int64_t G, int64_t hd, float scale, float* out,
            int64_t out_row);
// the same over bfloat16 keys and values (their bits; widened exactly)
void attend(const float* q, int64_t q_row, const uint16_t* keys, const uint16_t* values, int64_t kv_row,
            const bool* mask, int64_t T, int64_t end, int64_t r0, int64_t r1, int64_t G, int64_t hd, float scale,
            float* out, int64_t out_row);
// float32 x [T, K] times the panels of w [N, K] (dense_pack) (+ bias [N]) into y (row stride ldy), outputs [lo,
// hi) (lo a multiple of 32), as dense_panels
void dense_range(const float* x, const float* panels, const float* bias, float* y, int64_t ldy, int64_t T, int64_t K,
                 int64_t lo, int64_t hi, Isa isa);
// the same with bfloat16 panels (their bits) and no bias: each output's float32 sum rounded to bfloat16, as
// dense_panels rounds a bfloat16 one, and written as a float32
void dense_range(const float* x, const uint16_t* panels, float* y, int64_t ldy, int64_t T, int64_t K, int64_t lo,
                 int64_t hi, Isa isa);

// A block format (dsia/blockq.py BlockFormat; its int64 code: base | planes << 4 | scaled << 6 | halves << 7 |
// mins << 8 | log2(super) << 10 | -offset << 16). Each weight of a block of 32 inputs is an unsigned code u, and
// per output lane w = D a (u + offset) + Dm b, a and b integers per sub-block (of 16 inputs where `halves`, else 32),
// D and Dm float16 per super-block of `super` blocks (GGUF's 32-blocks: 1; its K-quants' 256: 8).
struct BlockFormat {
  int base;  // the codes' low bits: 4 (a nibble plane), 8 (a byte each) or 0 (bit planes alone)
  int planes;  // bit planes above them (0..3: a Q5's fifth bit, a Q6_K's two high bits, Q2_K/Q3_K's bits)
  bool scaled;  // an int8 multiplier a per lane and sub-block (else a = 1)
  bool halves;  // sub-blocks of 16 inputs (else 32)
  int mins;  // 0: no Dm term; 1: b = 1 (Q4_1, Q5_1: Dm the block's offset); 2: an int8 b per lane and sub-block
  int super;  // blocks per super-block: 1 or 8
  int offset;  // added to every code (0 down to -128: Q4_0's -8, Q8_0's -128 for its code + 128)
  // bytes per tile of 16 outputs and block: the base plane, the bit planes (64 bytes each), then a, then b
  int64_t base_bytes() const { return base * 64; }
  int64_t subblocks() const { return halves ? 2 : 1; }
  int64_t record() const { return base_bytes() + planes * 64 + (scaled ? 16 * subblocks() : 0) +
                                  (mins == 2 ? 16 * subblocks() : 0); }
};
BlockFormat block_format(int64_t code);  // (checked: one error naming what is wrong with the code)

// GGUF-style blocks as laid out by dsia/blockq.py: codes [tiles, blocks, record] (per tile and block: the base
// plane, 4 x 16 x 4 bytes (a nibble each, group g and g + 4) or 8 x 16 x 4; each bit plane's 8 groups, a 64-bit mask
// each, bit lane * 4 + j; then a [sub-blocks, 16] int8, b [sub-blocks, 16] int8), D (and Dm) [tiles, blocks / super,
// 16] float16 bits, for N outputs of K = 32 blocks inputs
struct Blocks {
  const uint8_t* codes;
  BlockFormat f;
  const uint16_t* d;
  const uint16_t* m;  // or nullptr (mins 0)
  int64_t N, K;
};
// a block product's activations: xq [T, K] int8, and per row and block dx [T, K / 32], per half block (16 inputs)
// the sum of its xq, xsum [T, K / 16], and per block dx times the sum of both halves' (rounded once), dxsum [T, K / 32]
struct BlockActs {
  int8_t* xq;
  float* dx;
  int32_t* xsum;
  float* dxsum;
};
constexpr int64_t kBlockInputs = 32;  // inputs per block
// blocks [b0, b1) of contiguous rows x [T, K] (block b: inputs [32 b, 32 b + 32) of x, and of a.xq), quantized to
// 8 bits as block_linear quantizes its activations
void quantize_blocks(const float* x, const BlockActs& a, int64_t b0, int64_t b1);
// the activations of the full tiles of 8 rows laid out by tile, as the AVX-512 path reads them (per row tile and
// block: the rows' 32 bytes, xsum pairs, dx, dxsum side by side); all null where `isa`'s path reads a's rows as they
// are (tile_acts: this thread's copy, valid until its next call; made once for the products that share a)
struct TiledActs {
  const int8_t* xq = nullptr;
  const int32_t* xsum = nullptr;
  const float* dx = nullptr;
  const float* dxsum = nullptr;
};
TiledActs tile_acts(const BlockActs& a, int64_t T, int64_t K, Isa isa);
// tiles [tile0, tile1) of 16 outputs of every row into out (row stride ldo), as block_linear (tiled: tile_acts(a),
// or none: made here)
void block_tiles(const Blocks& w, const BlockActs& a, const TiledActs& tiled, int64_t T, float* out, int64_t ldo,
                 int64_t tile0, int64_t tile1, Isa isa);
Isa block_isa();
}  // namespace raw

}  // namespace casspec
