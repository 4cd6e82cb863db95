// Typings of the kernscope Node-API binding (index.js).

/** Typed arrays a host tensor can view. Uint16Array holds fp16 or bf16 bit patterns. */
export type TypedData = Float32Array | Float64Array | Uint16Array | Int32Array | BigInt64Array | Uint8Array;

export type DTypeName = 'fp16' | 'bf16' | 'fp32' | 'fp64' | 'int32' | 'int64' | 'uint8';
export interface DLDataType { code: number; bits: number; lanes?: number }
export type DType = DTypeName | DLDataType;

export type DeviceName = 'cpu' | 'cuda' | 'cuda_host' | 'rocm' | 'cuda_managed' | `cuda:${number}`;
export interface DeviceSpec { type: Exclude<DeviceName, `cuda:${number}`> | number; id?: number }
export type Device = DeviceName | DeviceSpec;

export type BackendName = 'auto' | 'cpu' | 'cuda';
export type QType = 'none' | 'f32' | 'f16' | 'bf16' | 'q4_0' | 'q4_1' | 'q8_0' | number;

export interface TensorOptions {
  /** Default: from the typed array (Float32Array fp32, Int32Array int32, BigInt64Array int64,
   *  Uint8Array uint8, Float64Array fp64); required for Uint16Array and device pointers. */
  dtype?: DType;
  /** In elements; null/undefined for compact row-major. */
  strides?: ReadonlyArray<number> | null;
  /** Default 'cpu' for typed arrays, 'cuda' for BigInt pointers. */
  device?: Device;
  byteOffset?: number;
}

/** Per-call options: backend (default 'auto': by the tensors' device) and CUDA stream. */
export interface ExecOptions {
  backend?: BackendName | number;
  /** A cudaStream_t as BigInt (0n: the default stream). */
  stream?: bigint | number;
}

/** An immutable view of a typed array or of device memory. */
export class Tensor {
  constructor(data: TypedData | bigint, shape?: ReadonlyArray<number>, options?: TensorOptions);
  readonly data: TypedData | bigint;
  readonly dtype: string;
  readonly shape: ReadonlyArray<number>;
  readonly strides: ReadonlyArray<number> | null;
  readonly device: Readonly<{ type: string | number; id: number }>;
  readonly byteOffset: number;
  readonly numel: number;
  // DLPack fields read by the addon.
  readonly code: number;
  readonly bits: number;
  readonly lanes: number;
  readonly deviceType: number;
  readonly deviceId: number;
  reshape(shape: ReadonlyArray<number>): Tensor;
  withStrides(strides: ReadonlyArray<number> | null): Tensor;
  withDType(dtype: DType): Tensor;
  /** Labels the memory as living on `device`; the caller asserts it is usable there. */
  onDevice(device: Device): Tensor;
}

/** A Tensor, or the arguments of one as an object. */
export type TensorLike = Tensor | ({ data: TypedData | bigint; shape?: ReadonlyArray<number> } & TensorOptions);

export function tensor(data: TypedData | bigint, shape?: ReadonlyArray<number>, options?: TensorOptions): Tensor;
export function f32(data: Float32Array, shape?: ReadonlyArray<number>): Tensor;
export function f16(bits: Uint16Array, shape?: ReadonlyArray<number>): Tensor;
export function bf16(bits: Uint16Array, shape?: ReadonlyArray<number>): Tensor;
export function i32(data: Int32Array, shape?: ReadonlyArray<number>): Tensor;
export function i64(data: BigInt64Array, shape?: ReadonlyArray<number>): Tensor;
export function u8(data: Uint8Array, shape?: ReadonlyArray<number>): Tensor;
/** A CUDA device pointer as a tensor. */
export function devicePtr(ptr: bigint | number, dtype: DType, shape: ReadonlyArray<number>, deviceId?: number): Tensor;

export declare const Status: Readonly<{
  SUCCESS: 0;
  INVALID_ARGUMENT: 1;
  UNSUPPORTED_DTYPE: 2;
  UNSUPPORTED_DEVICE: 3;
  BACKEND_UNAVAILABLE: 4;
  CUDA: 5;
  OUT_OF_MEMORY: 6;
  INTERNAL: 7;
}>;

/** Thrown by every failing call; outputs are unchanged. */
export class KernscopeError extends Error {
  constructor(message: string, status: number);
  readonly name: 'KernscopeError';
  /** ks_status_t value (see Status). */
  readonly status: number;
  /** Stable status name, e.g. 'KS_ERROR_INVALID_ARGUMENT'. */
  readonly code: string;
}

export interface VariantInfo { op: string; backend: string; name: string; dtypes: string; summary: string }

export function version(): string;
/** ks_last_error() of this thread ('' after a success). */
export function lastError(): string;
export function statusName(status: number): string;
export function backendAvailable(backend: BackendName | number): boolean;
/** Deterministic (batch-invariant) mode, process-wide (KS_DETERMINISTIC=1 turns it on at start). */
export function setDeterministic(enabled: boolean): void;
export function deterministic(): boolean;
export function qtypeInfo(qtype: QType): { blockSize: number; blockBytes: number };
export function variants(): VariantInfo[];
/** The active routing table (first matching cell wins), parsed from ks_routing_table's JSON. */
export function routingTable(): { schema: string; files: string[]; cells: Array<{ op: string; backend: string; arch: string; dtype: string; qtype: string; rows: [number, number | null]; cols: [number, number | null]; order: string[]; basis: 'measured' | 'heuristic'; source: string; why: string; table: string; index: number }> };
/** The activations' dtype; for the packed-weight ops optionally followed by the weights' block
 *  format ("bf16:q4_1"), for the routing cells bound to one (docs/routing.md). */
export type WhichDtype = 'fp16' | 'bf16' | 'fp32' | `${'fp16' | 'bf16' | 'fp32'}:${'q4_0' | 'q4_1' | 'q8_0' | 'f32' | 'f16' | 'bf16'}`;
export function which(op: string, dtype: WhichDtype, backend?: BackendName | number): { variant: string; reason: string };
/** which() for a call of shape (rows, cols) as the routing table keys it (ks_which_shape;
 *  docs/routing.md#shape-keys). Throws on an unknown op, dtype or backend, a negative rows or
 *  cols (Status.INVALID_ARGUMENT), or a backend that is not available. */
export function whichShape(op: string, dtype: WhichDtype, rows: number, cols: number, backend?: BackendName | number): { variant: string; reason: string };
/** Pins op to variant for this thread; variant null: automatic again; op null: clear all pins. */
export function forceVariant(op: string | null, variant: string | null): void;
/** The variant pinned for op on this thread by forceVariant, or null (ks_forced_variant). */
export function forcedVariant(op: string): string | null;
export function lastLaunchConfig(op: string): string;
/** The op whose variants the entry point `op` runs ("paged_attention" for
 * "paged_attention_after_append"); null for any other name. */
export function opRunsVariantsOf(op: string): string | null;
/** Where the routing key's cols (whichShape) is a product, its factors' names ("N x K (...)" for
 * quantMatmul, "max_blocks_per_seq x block_size (...)" for pagedAttention); null otherwise. */
export function opColsFactors(op: string): string | null;

export function rmsNorm(out: TensorLike, x: TensorLike, weight: TensorLike, eps: number, opts?: ExecOptions): void;
export function fusedAddRmsNorm(x: TensorLike, residual: TensorLike, weight: TensorLike, eps: number, opts?: ExecOptions): void;
export function siluAndMul(out: TensorLike, x: TensorLike, opts?: ExecOptions): void;
export function gemv(out: TensorLike, x: TensorLike, weight: TensorLike, opts?: ExecOptions): void;
export function softmax(out: TensorLike, x: TensorLike, opts?: ExecOptions): void;
export function embedding(out: TensorLike, ids: TensorLike, table: TensorLike, tableFormat?: QType, opts?: ExecOptions): void;
export function dequantize(out: TensorLike, packed: TensorLike, qtype: QType, opts?: ExecOptions): void;
/** out[M, N] = a[M, K] @ b[N, K]^T; a may be [..., K] with out [..., N] (any leading dims, M their
 *  product, each row as in the 2-D reshape; a 1-D a gives out [N]). quantMatmul and quantMatmulA8 take
 *  x [..., K] the same way. */
export function gemm(out: TensorLike, a: TensorLike, b: TensorLike, opts?: ExecOptions): void;
export function quantMatmul(out: TensorLike, x: TensorLike, weight: TensorLike, qtype: QType, opts?: ExecOptions): void;
/** W4A8 / W8A8: quantMatmul with x quantized to int8 per block of 32 (llama.cpp's Q8_1 activations).
 *  x [M, K] (fp32, fp16 or bf16; K a multiple of 32), weight packed [N, K / 32 * blockBytes] (uint8) in
 *  qtype, which must be 'q4_0', 'q4_1' or 'q8_0'; out [M, N] in x's dtype. Per block of x:
 *  d = max|x| / 127, codes rint(x * 127 / max|x|) (ties to even); each block's dot product with the weight's
 *  codes is an exact int32 sum, its value formed in FP32, the blocks summed in FP32 in one fixed order:
 *  every backend gives the same bits. Differs from quantMatmul by up to about 1/254 of each x block's
 *  largest value per element. A NaN or +-Infinity in a block of x makes every output of its row NaN; a
 *  block with max|x| < 1.5e-36 counts as zero. weight is read-only (quantMatmul's rule on CUDA).
 *  Throws KernscopeError (nothing written): another qtype (INVALID_ARGUMENT, the message names qtype),
 *  shapes, a K that is not whole blocks, overlap (INVALID_ARGUMENT), mismatched dtypes or a weight that
 *  is not uint8 (UNSUPPORTED_DTYPE). Contract: docs/contracts.md#quant_matmul_a8. */
export function quantMatmulA8(out: TensorLike, x: TensorLike, weight: TensorLike, qtype: QType, opts?: ExecOptions): void;
/** Decode-step fusion, one kernel: the (fused add +) RMS norm of each row, then quantMatmul on it.
 *  residual [M, K] (or [..., K] with out [..., N]), normWeight [K], weight packed [N, rowBytes] in qtype,
 *  out [M, N]. With x ([M, K]):
 *  s = x + residual (FP32); residualOut ([M, K], required) = round(s);
 *  out = quantMatmul(round(rmsNorm(s) * normWeight)): fusedAddRmsNorm's values then quantMatmul, x and
 *  residual unchanged. x null: out = quantMatmul(round(rmsNorm(residual) * normWeight)), and
 *  residualOut must be null too. Throws KernscopeError (nothing written) for residualOut without x
 *  (or x without it), shapes, eps, overlap (INVALID_ARGUMENT) and mismatched dtypes (UNSUPPORTED_DTYPE). */
export function fusedAddRmsNormQuantMatmul(out: TensorLike, residualOut: TensorLike | null, x: TensorLike | null,
                                           residual: TensorLike, normWeight: TensorLike, eps: number,
                                           weight: TensorLike, qtype: QType, opts?: ExecOptions): void;
/** Decode-step fusion, one kernel: siluAndMul of gateUp [M, 2K] or [..., 2K] (gate, then up), then quantMatmul:
 *  out [M, N] = quantMatmul(round(silu(gate) * up), weight). Throws KernscopeError (nothing written)
 *  for an odd gateUp width, a K that is not whole blocks, bad shapes or overlap (INVALID_ARGUMENT). */
export function siluAndMulQuantMatmul(out: TensorLike, gateUp: TensorLike, weight: TensorLike, qtype: QType,
                                      opts?: ExecOptions): void;
export function rotaryEmbedding(q: TensorLike, k: TensorLike | null, positions: TensorLike, rotaryDim: number,
                                theta: number, isNeox: boolean, opts?: ExecOptions): void;
export function kvCacheAppend(kCache: TensorLike, vCache: TensorLike, k: TensorLike, v: TensorLike,
                              slotMapping: TensorLike, opts?: ExecOptions): void;
/** Decode-step fusion, one pass (one kernel on CUDA): rotaryEmbedding of q and k, then kvCacheAppend of the
 *  rotated k and of v; in place on q, k, kCache and vCache, bit for bit the two calls. q [numTokens, numHeads,
 *  headDim], k and v [numTokens, numKvHeads, headDim] (k is required), positions int32/int64 [numTokens],
 *  the caches [numBlocks, blockSize, numKvHeads, headDim], slotMapping int32/int64 [n <= numTokens] (slot -1
 *  skipped). Throws KernscopeError (nothing written) for every rule of the two ops, plus v overlapping q or k
 *  and a cache overlapping q or positions (INVALID_ARGUMENT), and mismatched dtypes (UNSUPPORTED_DTYPE). */
export function rotaryEmbeddingKvAppend(q: TensorLike, k: TensorLike, v: TensorLike, positions: TensorLike,
                                        rotaryDim: number, theta: number, isNeox: boolean, kCache: TensorLike,
                                        vCache: TensorLike, slotMapping: TensorLike, opts?: ExecOptions): void;
/** Decode-step fusion for one token: fusedAddRmsNormQuantMatmul into out, then rotaryEmbeddingKvAppend on out's
 *  column slices q = [:, 0 : H D], k = [:, H D : (H + KVH) D], v = [:, (H + KVH) D :] seen as [1, H, D],
 *  [1, KVH, D], [1, KVH, D] (H = numHeads, KVH = numKvHeads, D = N / (H + 2 KVH)), in one kernel on CUDA where it
 *  can; bit for bit the two calls. residual [1, K] (one row; [0, K] does nothing), x, residualOut, normWeight,
 *  eps, weight and qtype as in fusedAddRmsNormQuantMatmul (x and residualOut both given or both null); out
 *  [1, N] with N = weight's rows = (H + 2 KVH) D, its q and k rotated on return; positions, rotaryDim, theta,
 *  isNeox, kCache, vCache and slotMapping ([1] or [0]) as in rotaryEmbeddingKvAppend. Throws KernscopeError
 *  (nothing written) for every rule of the two ops under this op's name, plus more than one row, numHeads or
 *  numKvHeads <= 0, N not a multiple of H + 2 KVH, and the caches, positions or slotMapping overlapping the
 *  matmul's tensors (INVALID_ARGUMENT), and mismatched dtypes (UNSUPPORTED_DTYPE). */
export function fusedAddRmsNormQuantMatmulRopeKvAppend(out: TensorLike, residualOut: TensorLike | null,
                                                       x: TensorLike | null, residual: TensorLike,
                                                       normWeight: TensorLike, eps: number, weight: TensorLike,
                                                       qtype: QType, numHeads: number, numKvHeads: number,
                                                       positions: TensorLike, rotaryDim: number, theta: number,
                                                       isNeox: boolean, kCache: TensorLike, vCache: TensorLike,
                                                       slotMapping: TensorLike, opts?: ExecOptions): void;
export function pagedAttention(out: TensorLike, q: TensorLike, kCache: TensorLike, vCache: TensorLike,
                               blockTables: TensorLike, seqIds: TensorLike | null, contextLens: TensorLike,
                               scale: number, opts?: ExecOptions): void;
/** pagedAttention for the call right after the one that appended the step's keys on the same stream
 *  (kvCacheAppend, rotaryEmbeddingKvAppend or fusedAddRmsNormQuantMatmulRopeKvAppend). freshKeys >= 1 (an
 *  integer: number or BigInt) is the caller's promise that the kernel launched just before on this stream wrote,
 *  for every token t, no kCache or vCache row that t reads below contextLens[t] - freshKeys, and none of
 *  blockTables, seqIds and contextLens: CUDA may then read the older keys before it ends (a broken promise may read a row
 *  before it is written). freshKeys 0 makes no promise. The result is pagedAttention's, bit for bit, whatever
 *  freshKeys is. Throws KernscopeError (nothing written) for pagedAttention's rules under this op's name
 *  (paged_attention_after_append), and freshKeys < 0 (INVALID_ARGUMENT). */
export function pagedAttentionAfterAppend(out: TensorLike, q: TensorLike, kCache: TensorLike, vCache: TensorLike,
                                          blockTables: TensorLike, seqIds: TensorLike | null,
                                          contextLens: TensorLike, scale: number, freshKeys: number | bigint,
                                          opts?: ExecOptions): void;
/** Decode-step fusion: rotaryEmbeddingKvAppend(q, k, v, positions, rotaryDim, theta, isNeox, kCache, vCache,
 *  slotMapping), then pagedAttention(out, q, kCache, vCache, blockTables, seqIds, contextLens, scale), in one
 *  kernel on CUDA where it can: q and k rotated in place, the caches given the new rows, out [numTokens,
 *  numHeads, headDim] the attention of the rotated q over the appended caches (k is required; seqIds null:
 *  token t is sequence t). Bit for bit the two calls when no token reads a cache slot that another token of
 *  the call appends (a decode step; the CPU is always the two calls). Throws KernscopeError (nothing written)
 *  for every rule of the two ops under this op's name, plus out overlapping q, k, v, positions, slotMapping or
 *  the caches (INVALID_ARGUMENT), and mismatched dtypes (UNSUPPORTED_DTYPE). */
export function rotaryEmbeddingKvAppendPagedAttention(out: TensorLike, q: TensorLike, k: TensorLike, v: TensorLike,
                                                      positions: TensorLike, rotaryDim: number, theta: number,
                                                      isNeox: boolean, kCache: TensorLike, vCache: TensorLike,
                                                      slotMapping: TensorLike, blockTables: TensorLike,
                                                      seqIds: TensorLike | null, contextLens: TensorLike,
                                                      scale: number, opts?: ExecOptions): void;
export function argmax(out: TensorLike, x: TensorLike, opts?: ExecOptions): void;
/** Attention over packed sequences (int32 offsets [numSeqs + 1]); causal: bottom-right aligned mask. */
export function varlenAttention(out: TensorLike, q: TensorLike, k: TensorLike, v: TensorLike, cuSeqlensQ: TensorLike,
                                cuSeqlensK: TensorLike, scale: number, causal: boolean, opts?: ExecOptions): void;
/** One token id per row (int64 out): temperature, top-k (0: off), top-p (1: off), Philox draw keyed by
 * seedOffset = [seed, offset] (int64 [2]); valid (uint8, or null) is 0 for a row without a distribution. */
export function sample(out: TensorLike, valid: TensorLike | null, logits: TensorLike, seedOffset: TensorLike,
                       temperature: number, topK: number, topP: number, opts?: ExecOptions): void;
