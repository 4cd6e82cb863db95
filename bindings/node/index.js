'use strict';
// kernscope for Node.js: a Node-API addon (src/kernscope_node.c, built with CMake) and this
// wrapper. Tensors are views over typed arrays (or BigInt device pointers) with a dtype, shape,
// strides and device; failing calls throw KernscopeError with the library's status and message.

const path = require('node:path');

function loadAddon() {
  const candidates = [];
  if (process.env.KERNSCOPE_NODE_ADDON) candidates.push(path.resolve(process.env.KERNSCOPE_NODE_ADDON));
  candidates.push(path.join(__dirname, 'build', 'kernscope.node'));
  candidates.push(path.join(__dirname, '..', '..', 'build', 'bindings', 'node', 'kernscope.node'));
  const errors = [];
  for (const file of candidates) {
    try {
      return require(file);
    } catch (e) {
      errors.push(`${file}: ${e.message.split('\n')[0]}`);
    }
  }
  throw new Error('kernscope: cannot load the addon (build bindings/node with CMake, or set KERNSCOPE_NODE_ADDON):\n  ' +
                  errors.join('\n  '));
}

const native = loadAddon();

/** Status codes of the C ABI (ks_status_t). */
const Status = Object.freeze({
  SUCCESS: 0,
  INVALID_ARGUMENT: 1,
  UNSUPPORTED_DTYPE: 2,
  UNSUPPORTED_DEVICE: 3,
  BACKEND_UNAVAILABLE: 4,
  CUDA: 5,
  OUT_OF_MEMORY: 6,
  INTERNAL: 7,
});

/** A failed kernscope call: `status` (number), `code` (e.g. 'KS_ERROR_INVALID_ARGUMENT') and
 *  the library's message naming the op and the argument. */
class KernscopeError extends Error {
  constructor(message, status) {
    super(message);
    this.name = 'KernscopeError';
    this.status = status;
    this.code = native.statusName(status);
  }
}
native.setErrorClass(KernscopeError);

const DTYPES = Object.freeze({
  fp16: { code: 2, bits: 16, lanes: 1 },
  bf16: { code: 4, bits: 16, lanes: 1 },
  fp32: { code: 2, bits: 32, lanes: 1 },
  fp64: { code: 2, bits: 64, lanes: 1 },
  int32: { code: 0, bits: 32, lanes: 1 },
  int64: { code: 0, bits: 64, lanes: 1 },
  uint8: { code: 1, bits: 8, lanes: 1 },
});

// The dtype a typed array implies; Uint16Array must say fp16 or bf16.
function defaultDType(data) {
  if (data instanceof Float32Array) return 'fp32';
  if (data instanceof Float64Array) return 'fp64';
  if (data instanceof Int32Array) return 'int32';
  if (data instanceof BigInt64Array) return 'int64';
  if (data instanceof Uint8Array) return 'uint8';
  return undefined;
}

const BACKENDS = Object.freeze({ auto: 0, cpu: 1, cuda: 2 });
const DEVICES = Object.freeze({ cpu: 1, cuda: 2, cuda_host: 3, rocm: 10, cuda_managed: 13 });
const QTYPES = Object.freeze({ none: 0, f32: 1, f16: 2, bf16: 3, q4_0: 4, q4_1: 5, q8_0: 6 });

function resolveDType(dtype) {
  if (typeof dtype === 'string') {
    const d = DTYPES[dtype];
    if (!d) throw new TypeError(`kernscope: unknown dtype '${dtype}' (${Object.keys(DTYPES).join(', ')})`);
    return { name: dtype, ...d };
  }
  if (dtype && typeof dtype === 'object') {
    const { code, bits, lanes = 1 } = dtype;
    const name = Object.keys(DTYPES).find((k) => DTYPES[k].code === code && DTYPES[k].bits === bits && lanes === 1) ||
                 `dlpack(code=${code},bits=${bits},lanes=${lanes})`;
    return { name, code, bits, lanes };
  }
  throw new TypeError('kernscope: dtype must be a name or {code, bits, lanes}');
}

function resolveDevice(device) {
  if (device === undefined || device === 'cpu') return { type: 'cpu', id: 0, deviceType: 1 };
  if (typeof device === 'string') {
    const [name, id = '0'] = device.split(':');
    if (!(name in DEVICES)) throw new TypeError(`kernscope: unknown device '${device}'`);
    return { type: name, id: Number(id), deviceType: DEVICES[name] };
  }
  if (device && typeof device === 'object') {
    const type = device.type ?? 'cpu';
    const deviceType = typeof type === 'number' ? type : DEVICES[type];
    if (deviceType === undefined) throw new TypeError(`kernscope: unknown device type '${type}'`);
    return { type, id: device.id ?? 0, deviceType };
  }
  throw new TypeError("kernscope: device must be 'cpu', 'cuda', 'cuda:N' or {type, id}");
}

/** A view of a typed array (or a BigInt device pointer) with dtype, shape, strides, device.
 *  Immutable; withStrides, withDType, onDevice and reshape return new views. */
class Tensor {
  constructor(data, shape, options = {}) {
    const isPtr = typeof data === 'bigint';
    if (!isPtr && !ArrayBuffer.isView(data)) {
      throw new TypeError('kernscope: tensor data must be a typed array or a BigInt device pointer');
    }
    if (shape === undefined) {
      if (isPtr) throw new TypeError('kernscope: a device-pointer tensor needs a shape');
      shape = [data.length];
    }
    const dtypeSpec = options.dtype ?? (isPtr ? undefined : defaultDType(data));
    if (dtypeSpec === undefined) {
      throw new TypeError(isPtr ? 'kernscope: a device-pointer tensor needs a dtype'
                                : 'kernscope: a Uint16Array needs dtype fp16 or bf16');
    }
    const dt = resolveDType(dtypeSpec);
    if (!isPtr && data.BYTES_PER_ELEMENT !== (dt.bits * dt.lanes + 7) >> 3) {
      throw new TypeError(`kernscope: a ${data.constructor.name} cannot hold ${dt.name} elements`);
    }
    const dev = resolveDevice(options.device ?? (isPtr ? 'cuda' : 'cpu'));
    this.data = data;
    this.dtype = dt.name;
    this.shape = Object.freeze(Array.from(shape, Number));
    this.strides = options.strides == null ? null : Object.freeze(Array.from(options.strides, Number));
    this.device = Object.freeze({ type: dev.type, id: dev.id });
    this.byteOffset = Number(options.byteOffset ?? 0);
    // Read by the addon.
    this.code = dt.code;
    this.bits = dt.bits;
    this.lanes = dt.lanes;
    this.deviceType = dev.deviceType;
    this.deviceId = dev.id;
    Object.freeze(this);
  }

  get numel() {
    return this.shape.reduce((a, b) => a * b, 1);
  }

  #options() {
    return { dtype: { code: this.code, bits: this.bits, lanes: this.lanes }, strides: this.strides,
             device: { type: this.deviceType, id: this.deviceId }, byteOffset: this.byteOffset };
  }
  reshape(shape) {
    return new Tensor(this.data, shape, { ...this.#options(), strides: null });
  }
  withStrides(strides) {
    return new Tensor(this.data, this.shape, { ...this.#options(), strides });
  }
  withDType(dtype) {
    return new Tensor(this.data, this.shape, { ...this.#options(), dtype });
  }
  /** Labels the memory as living on `device`; the caller asserts it is usable there. */
  onDevice(device) {
    return new Tensor(this.data, this.shape, { ...this.#options(), device });
  }
}

/** tensor(data, shape?, {dtype?, strides?, device?, byteOffset?}) */
function tensor(data, shape, options) {
  return new Tensor(data, shape, options);
}

const f32 = (data, shape) => new Tensor(data, shape, { dtype: 'fp32' });
const f16 = (data, shape) => new Tensor(data, shape, { dtype: 'fp16' });
const bf16 = (data, shape) => new Tensor(data, shape, { dtype: 'bf16' });
const i32 = (data, shape) => new Tensor(data, shape, { dtype: 'int32' });
const i64 = (data, shape) => new Tensor(data, shape, { dtype: 'int64' });
const u8 = (data, shape) => new Tensor(data, shape, { dtype: 'uint8' });
/** A CUDA device pointer (BigInt) as a tensor. */
const devicePtr = (ptr, dtype, shape, deviceId = 0) => new Tensor(BigInt(ptr), shape, { dtype, device: { type: 'cuda', id: deviceId } });

// Accepts a Tensor or {data, shape, ...options}.
function T(t, required = true) {
  if (t instanceof Tensor) return t;
  if (t == null) {
    if (required) throw new TypeError('kernscope: missing tensor argument');
    return null;
  }
  if (typeof t === 'object' && 'data' in t) return new Tensor(t.data, t.shape, t);
  throw new TypeError('kernscope: expected a Tensor or {data, shape}');
}

function exec(opts = {}) {
  const b = opts.backend ?? 'auto';
  const backend = typeof b === 'number' ? b : BACKENDS[b];
  if (backend === undefined) throw new TypeError(`kernscope: unknown backend '${b}'`);
  const stream = opts.stream == null ? 0n : BigInt(opts.stream);
  return [backend, stream];
}

function qtype(q) {
  const v = typeof q === 'number' ? q : QTYPES[String(q).toLowerCase()];
  if (v === undefined) throw new TypeError(`kernscope: unknown qtype '${q}'`);
  return v;
}

module.exports = {
  Status, KernscopeError, Tensor, tensor, f32, f16, bf16, i32, i64, u8, devicePtr,

  version: () => native.version(),
  lastError: () => native.lastError(),
  statusName: (status) => native.statusName(status),
  backendAvailable: (backend) => native.backendAvailable(exec({ backend })[0]),
  setDeterministic: (enabled) => { native.setDeterministic(Boolean(enabled)); },
  deterministic: () => native.deterministic(),
  qtypeInfo: (q) => {
    const [blockSize, blockBytes] = native.qtypeInfo(qtype(q));
    return { blockSize, blockBytes };
  },
  variants: () => native.variants(),
  which: (op, dtype, backend = 'auto') => native.which(op, dtype, exec({ backend })[0]),
  whichShape: (op, dtype, rows, cols, backend = 'auto') => native.whichShape(op, dtype, exec({ backend })[0], rows, cols),
  routingTable: () => JSON.parse(native.routingTable()),
  forceVariant: (op, variant) => native.forceVariant(op ?? null, variant ?? null),
  forcedVariant: (op) => native.forcedVariant(op),
  lastLaunchConfig: (op) => native.lastLaunchConfig(op),
  opRunsVariantsOf: (op) => native.opRunsVariantsOf(op),
  opColsFactors: (op) => native.opColsFactors(op),

  rmsNorm: (out, x, weight, eps, opts) => native.rmsNorm(T(out), T(x), T(weight), eps, ...exec(opts)),
  fusedAddRmsNorm: (x, residual, weight, eps, opts) =>
    native.fusedAddRmsNorm(T(x), T(residual), T(weight), eps, ...exec(opts)),
  siluAndMul: (out, x, opts) => native.siluAndMul(T(out), T(x), ...exec(opts)),
  gemv: (out, x, weight, opts) => native.gemv(T(out), T(x), T(weight), ...exec(opts)),
  softmax: (out, x, opts) => native.softmax(T(out), T(x), ...exec(opts)),
  embedding: (out, ids, table, tableFormat = 'none', opts) =>
    native.embedding(T(out), T(ids), T(table), qtype(tableFormat), ...exec(opts)),
  dequantize: (out, packed, q, opts) => native.dequantize(T(out), T(packed), qtype(q), ...exec(opts)),
  gemm: (out, a, b, opts) => native.gemm(T(out), T(a), T(b), ...exec(opts)),
  quantMatmul: (out, x, weight, q, opts) => native.quantMatmul(T(out), T(x), T(weight), qtype(q), ...exec(opts)),
  quantMatmulA8: (out, x, weight, q, opts) => native.quantMatmulA8(T(out), T(x), T(weight), qtype(q), ...exec(opts)),
  fusedAddRmsNormQuantMatmul: (out, residualOut, x, residual, normWeight, eps, weight, q, opts) =>
    native.fusedAddRmsNormQuantMatmul(T(out), T(residualOut, false), T(x, false), T(residual), T(normWeight), eps,
                                      T(weight), qtype(q), ...exec(opts)),
  siluAndMulQuantMatmul: (out, gateUp, weight, q, opts) =>
    native.siluAndMulQuantMatmul(T(out), T(gateUp), T(weight), qtype(q), ...exec(opts)),
  rotaryEmbedding: (q, k, positions, rotaryDim, theta, isNeox, opts) =>
    native.rotaryEmbedding(T(q), T(k, false), T(positions), rotaryDim, theta, Boolean(isNeox), ...exec(opts)),
  kvCacheAppend: (kCache, vCache, k, v, slotMapping, opts) =>
    native.kvCacheAppend(T(kCache), T(vCache), T(k), T(v), T(slotMapping), ...exec(opts)),
  rotaryEmbeddingKvAppend: (q, k, v, positions, rotaryDim, theta, isNeox, kCache, vCache, slotMapping, opts) =>
    native.rotaryEmbeddingKvAppend(T(q), T(k), T(v), T(positions), rotaryDim, theta, Boolean(isNeox), T(kCache),
                                   T(vCache), T(slotMapping), ...exec(opts)),
  fusedAddRmsNormQuantMatmulRopeKvAppend: (out, residualOut, x, residual, normWeight, eps, weight, q, numHeads,
                                           numKvHeads, positions, rotaryDim, theta, isNeox, kCache, vCache,
                                           slotMapping, opts) =>
    native.fusedAddRmsNormQuantMatmulRopeKvAppend(T(out), T(residualOut, false), T(x, false), T(residual),
                                                  T(normWeight), eps, T(weight), qtype(q), numHeads, numKvHeads,
                                                  T(positions), rotaryDim, theta, Boolean(isNeox), T(kCache),
                                                  T(vCache), T(slotMapping), ...exec(opts)),
  pagedAttention: (out, q, kCache, vCache, blockTables, seqIds, contextLens, scale, opts) =>
    native.pagedAttention(T(out), T(q), T(kCache), T(vCache), T(blockTables), T(seqIds, false), T(contextLens), scale,
                          ...exec(opts)),
  pagedAttentionAfterAppend: (out, q, kCache, vCache, blockTables, seqIds, contextLens, scale, freshKeys, opts) =>
    native.pagedAttentionAfterAppend(T(out), T(q), T(kCache), T(vCache), T(blockTables), T(seqIds, false),
                                     T(contextLens), scale, freshKeys, ...exec(opts)),
  rotaryEmbeddingKvAppendPagedAttention: (out, q, k, v, positions, rotaryDim, theta, isNeox, kCache, vCache,
                                          slotMapping, blockTables, seqIds, contextLens, scale, opts) =>
    native.rotaryEmbeddingKvAppendPagedAttention(T(out), T(q), T(k), T(v), T(positions), rotaryDim, theta,
                                                 Boolean(isNeox), T(kCache), T(vCache), T(slotMapping),
                                                 T(blockTables), T(seqIds, false), T(contextLens), scale,
                                                 ...exec(opts)),
  argmax: (out, x, opts) => native.argmax(T(out), T(x), ...exec(opts)),
  varlenAttention: (out, q, k, v, cuSeqlensQ, cuSeqlensK, scale, causal, opts) =>
    native.varlenAttention(T(out), T(q), T(k), T(v), T(cuSeqlensQ), T(cuSeqlensK), scale, Boolean(causal), ...exec(opts)),
  sample: (out, valid, logits, seedOffset, temperature, topK, topP, opts) =>
    native.sample(T(out), T(valid, false), T(logits), T(seedOffset), temperature, topK, topP, ...exec(opts)),
};
