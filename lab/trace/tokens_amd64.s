#include "textflag.h"

// func blockTokensAVX512(out *[512]uint32, first *[8]uint64)
//
// Per lane: z = mix64(s); the pair's tokens are lo32(z)·Vocab >> 32 and
// hi32(z)·Vocab >> 32, stored as one little-endian quadword (the second
// token is the high half's product with its low 32 bits cleared).
TEXT ·blockTokensAVX512(SB), NOSPLIT, $0-16
	MOVQ out+0(FP), DI
	MOVQ first+8(FP), SI
	VMOVDQU64 (SI), Z8               // s, eight pairs' states
	MOVQ $0xbf58476d1ce4e5b9, AX
	VPBROADCASTQ AX, Z2              // mix64's first multiplier
	MOVQ $0x94d049bb133111eb, AX
	VPBROADCASTQ AX, Z3              // its second
	MOVQ $128000, AX
	VPBROADCASTQ AX, Z5              // Vocab
	MOVQ $0xffffffff00000000, AX
	VPBROADCASTQ AX, Z6
	MOVQ $0xf1bbcdcbfa53e0a8, AX     // 8·golden, mod 2^64
	VPBROADCASTQ AX, Z7
	MOVQ $32, CX                     // 32 × 8 pairs = 512 tokens

loop:
	VPSRLQ $30, Z8, Z1
	VPXORQ Z1, Z8, Z0
	VPMULLQ Z2, Z0, Z0
	VPSRLQ $27, Z0, Z1
	VPXORQ Z1, Z0, Z0
	VPMULLQ Z3, Z0, Z0
	VPSRLQ $31, Z0, Z1
	VPXORQ Z1, Z0, Z0
	VPMULUDQ Z5, Z0, Z1              // lo32(z)·Vocab
	VPSRLQ $32, Z1, Z1
	VPSRLQ $32, Z0, Z4
	VPMULUDQ Z5, Z4, Z4              // hi32(z)·Vocab
	VPANDQ Z6, Z4, Z4
	VPORQ Z4, Z1, Z1
	VMOVDQU64 Z1, (DI)
	VPADDQ Z7, Z8, Z8
	ADDQ $64, DI
	DECQ CX
	JNZ loop
	VZEROUPPER
	RET
