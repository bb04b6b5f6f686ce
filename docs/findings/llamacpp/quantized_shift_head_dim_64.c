/* The head-size control of quantized_shift_head_dim_96.c (see
 * quantized-shift-crashes-without-k-rotation.md): the same q8_0 K cache and shift at head
 * size 64, where llama.cpp stores K rotated and the shift has its Hadamard matrix. Exit 0
 * when the decode after the shift is done. Under LLAMA_ATTN_ROT_DISABLE=1 it crashes too.
 *
 *   quantized_shift_head_dim_64 LIB_DIR   (LIB_DIR: libllama and its CPU backends) */
#define TINY_HEAD_DIM 64
#include "quantized_shift_head_dim_96.c"
