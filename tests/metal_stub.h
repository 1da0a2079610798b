// Stands in for what MLX prepends to a custom Metal kernel (its utils header: <metal_stdlib>, `using
// namespace metal`) so that clang can check our kernels' syntax and types on a machine without Apple's
// compiler (tests/metal_clang.py). Address spaces are clang's address_space attributes, so passing a
// `constant` pointer where a `device` one is declared is an error, as in Metal. Only what the kernels use;
// a name missing here is an error too (add it here only if Metal has it).
#pragma once
#define device __attribute__((address_space(1)))
#define constant __attribute__((address_space(2)))
#define threadgroup __attribute__((address_space(3)))
#define thread
#define INFINITY __builtin_inff()
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned int uint3 __attribute__((ext_vector_type(3)));
typedef _Float16 float16_t;  // MLX's names for Metal's half and bfloat (its get_type_string)
typedef __bf16 bfloat16_t;
typedef signed char int8_t;
typedef int int32_t;

namespace metal {
template <typename T, typename U> T as_type(U x);  // a reinterpretation of x's bits (types of one size)
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
mem_flags operator|(mem_flags a, mem_flags b);
void threadgroup_barrier(mem_flags flags);
template <typename T> T simd_shuffle_xor(T data, ushort mask);  // scalar types only, in Metal
float max(float a, float b);
int max(int a, int b);
float min(float a, float b);
int min(int a, int b);
float exp(float x);
float rint(float x);  // to the nearest integer, ties to even (the default rounding mode)
float fma(float a, float b, float c);  // a * b + c rounded once (Metal's fma: fused whatever the contract pragma)
namespace precise {
float exp(float x);
float divide(float a, float b);
float tanh(float x);
float rsqrt(float x);
float sqrt(float x);
float exp2(float x);
}  // namespace precise
namespace fast {
float exp(float x);
float divide(float a, float b);
float cos(float x);
float sin(float x);
}  // namespace fast
}  // namespace metal
using namespace metal;
