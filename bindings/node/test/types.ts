// Compile-only check of index.d.ts (tsc --noEmit -p test/tsconfig.json); run_tests.sh runs it
// when a TypeScript compiler (Debian's node-typescript) is installed.
import * as ks from '..';

const x = new Float32Array([1, 2, 3, 4, -1, 0.5, 2, 8]);
const y = new Float32Array(8);
const w = new Float32Array([1, 1, 0.5, 2]);
ks.rmsNorm(ks.f32(y, [2, 4]), ks.f32(x, [2, 4]), ks.f32(w), 1e-6);
ks.rmsNorm({ data: y, shape: [2, 4] }, ks.tensor(x, [2, 4], { dtype: 'fp32' }), ks.f32(w), 1e-6, { backend: 'cpu' });
ks.softmax(ks.f32(y, [2, 4]), ks.f32(x, [2, 4]).withStrides([4, 1]).onDevice('cpu'));
const h: ks.Tensor = ks.tensor(new Uint16Array(8), [2, 4], { dtype: 'bf16', device: { type: 'cpu' } });
const d: ks.Tensor = ks.devicePtr(0x7f0000000000n, 'fp16', [2, 4], 0);
ks.embedding(ks.f32(y, [2, 4]), ks.i64(new BigInt64Array([0n, 1n])), ks.f32(x, [2, 4]), 'none');
ks.rotaryEmbedding(h, null, ks.i32(new Int32Array(2)), 4, 10000, true, { backend: 'cuda', stream: 0n });
const t = ks.f32(x, [1, 2, 4]);
ks.pagedAttention(t, t, t, t, ks.i32(new Int32Array(1)), null, ks.i32(new Int32Array(1)), 0.5);
ks.pagedAttentionAfterAppend(t, t, t, t, ks.i32(new Int32Array(1)), null, ks.i32(new Int32Array(1)), 0.5, 1);
ks.pagedAttentionAfterAppend(t, t, t, t, ks.i32(new Int32Array(1)), null, ks.i32(new Int32Array(1)), 0.5, 1n,
                             { backend: 'cpu' });
// @ts-expect-error a bare typed array is not a tensor (index.js throws TypeError)
ks.softmax(y, x);
// @ts-expect-error Uint16Array needs a dtype; 'fp8' is not one
ks.tensor(new Uint16Array(2), [2], { dtype: 'fp8' });
ks.forceVariant('rms_norm', null);
const pinned: string | null = ks.forcedVariant('rms_norm');
const runs: string | null = ks.opRunsVariantsOf('paged_attention_after_append');
const factors: string | null = ks.opColsFactors('quant_matmul');
const info: { blockSize: number; blockBytes: number } = ks.qtypeInfo('q4_1');
const choice: { variant: string; reason: string } = ks.which('rms_norm', 'bf16', 'cpu');
const firstOrder: string[] = ks.routingTable().cells[0].order;
try {
  ks.rmsNorm(ks.f32(y, [2, 4]), ks.f32(x, [2, 4]), ks.f32(w), 0);
} catch (e) {
  if (e instanceof ks.KernscopeError && e.status === ks.Status.INVALID_ARGUMENT) {
    const code: string = e.code;
    void code;
  }
}
void d, info, choice;
const ws: string = ks.whichShape('quant_matmul', 'fp32', 1, 576, 'cpu').variant;
const wq: string = ks.whichShape('quant_matmul', 'bf16:q4_1', 1, 49152 * 576, 'cpu').variant;
const qt: string = ks.routingTable().cells[0].qtype;
const packed = ks.u8(new Uint8Array(3 * 34), [3, 34]);
const r2 = ks.f32(new Float32Array(64), [2, 32]);
ks.fusedAddRmsNormQuantMatmul(ks.f32(new Float32Array(6), [2, 3]), r2, r2, r2, ks.f32(new Float32Array(32)), 1e-6,
                              packed, 'q8_0', { backend: 'cpu' });
ks.fusedAddRmsNormQuantMatmul(ks.f32(new Float32Array(6), [2, 3]), null, null, r2, ks.f32(new Float32Array(32)), 1e-6,
                              packed, ks.qtypeInfo('q8_0').blockSize === 32 ? 'q8_0' : 6);
ks.siluAndMulQuantMatmul(ks.f32(new Float32Array(3), [1, 3]), ks.f32(new Float32Array(64), [1, 64]), packed, 'q8_0');
ks.quantMatmulA8(ks.f32(new Float32Array(3), [1, 3]), ks.f32(new Float32Array(32), [1, 32]), packed, 'q8_0',
                 { backend: 'cpu' });
ks.quantMatmulA8(ks.f32(new Float32Array(3), [1, 3]), ks.f32(new Float32Array(32), [1, 32]), packed, 6);
// @ts-expect-error qtype is a QType name or number
ks.quantMatmulA8(ks.f32(new Float32Array(3), [1, 3]), ks.f32(new Float32Array(32), [1, 32]), packed, true);
// @ts-expect-error eps is a number
ks.fusedAddRmsNormQuantMatmul(r2, null, null, r2, r2, '1e-6', packed, 'q8_0');
const kv = ks.f32(new Float32Array(16), [2, 1, 8]);
const cache = ks.f32(new Float32Array(32), [2, 2, 1, 8]);
ks.rotaryEmbeddingKvAppend(ks.f32(new Float32Array(32), [2, 2, 8]), kv, kv, ks.i32(new Int32Array(2)), 8, 10000, true,
                           cache, cache, ks.i64(new BigInt64Array(2)), { backend: 'cpu' });
// @ts-expect-error k is required
ks.rotaryEmbeddingKvAppend(kv, null, kv, ks.i32(new Int32Array(2)), 8, 10000, true, cache, cache, kv);
const row = ks.f32(new Float32Array(32), [1, 32]);
const packed32 = ks.u8(new Uint8Array(32 * 34), [32, 34]);
ks.fusedAddRmsNormQuantMatmulRopeKvAppend(ks.f32(new Float32Array(32), [1, 32]), row, row, row,
                                          ks.f32(new Float32Array(32)), 1e-6, packed32, 'q8_0', 2, 1,
                                          ks.i32(new Int32Array(1)), 8, 10000, false, cache, cache,
                                          ks.i64(new BigInt64Array(1)), { backend: 'cpu' });
ks.fusedAddRmsNormQuantMatmulRopeKvAppend(ks.f32(new Float32Array(32), [1, 32]), null, null, row,
                                          ks.f32(new Float32Array(32)), 1e-6, packed32, 6, 2, 1,
                                          ks.i32(new Int32Array(1)), 8, 10000, true, cache, cache,
                                          ks.i32(new Int32Array(1)));
// @ts-expect-error num_heads is a number
ks.fusedAddRmsNormQuantMatmulRopeKvAppend(row, null, null, row, row, 1e-6, packed32, 'q8_0', '2', 1, kv, 8, 10000,
                                          true, cache, cache, kv);
const q6 = ks.f32(new Float32Array(2 * 2 * 8), [2, 2, 8]);
ks.rotaryEmbeddingKvAppendPagedAttention(ks.f32(new Float32Array(32), [2, 2, 8]), q6, kv, kv, ks.i32(new Int32Array(2)),
                                         8, 10000, true, cache, cache, ks.i64(new BigInt64Array(2)),
                                         ks.i32(new Int32Array(2), [2, 1]), null, ks.i32(new Int32Array(2)), 0.35,
                                         { backend: 'cpu' });
ks.rotaryEmbeddingKvAppendPagedAttention(q6, q6, kv, kv, ks.i64(new BigInt64Array(2)), 4, 10000, false, cache, cache,
                                         ks.i32(new Int32Array(2)), ks.i32(new Int32Array(2), [1, 2]),
                                         ks.i32(new Int32Array(2)), ks.i32(new Int32Array(2)), 0.5);
// @ts-expect-error k is required
ks.rotaryEmbeddingKvAppendPagedAttention(q6, q6, null, kv, kv, 8, 10000, true, cache, cache, kv, kv, null, kv, 0.5);
