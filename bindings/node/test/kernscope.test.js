'use strict';
// The cases of tests/c/test_c_api.c through the Node binding, against double-precision
// references computed here: values, one error per validation class (message naming the op and
// the argument, outputs unchanged), the registry. Run: node --test test/kernscope.test.js
// (KERNSCOPE_NODE_ADDON=path/to/kernscope.node).
const test = require('node:test');
const assert = require('node:assert/strict');
const ks = require('..');

const X = [0.5, -1.25, 2.0, 3.5, -0.75, 1.0, 2.0, -3.0, 4.0, 0.125];
const W = [1.0, 0.5, -2.0, 1.5, 0.25];

const close = (got, want, tol) => Math.abs(got - want) <= tol + tol * Math.abs(want);

function assertClose(got, want, tol, what) {
  assert.equal(got.length, want.length);
  for (let i = 0; i < want.length; i++) {
    assert.ok(close(got[i], want[i], tol), `${what}[${i}] = ${got[i]}, want ${want[i]}`);
  }
}

function rmsNormRef(x, w, eps) {
  const h = w.length;
  const out = [];
  for (let r = 0; r < x.length / h; r++) {
    let ss = 0;
    for (let i = 0; i < h; i++) ss += x[r * h + i] * x[r * h + i];
    const scale = 1 / Math.sqrt(ss / h + eps);
    for (let i = 0; i < h; i++) out.push(x[r * h + i] * scale * w[i]);
  }
  return out;
}

// Asserts a KernscopeError with `status` whose message names every word.
function expectError(fn, status, ...words) {
  assert.throws(fn, (e) => {
    assert.ok(e instanceof ks.KernscopeError, `not a KernscopeError: ${e}`);
    assert.ok(e instanceof Error);
    assert.equal(e.status, status);
    assert.equal(e.code, ks.statusName(status));
    for (const w of words) assert.ok(e.message.includes(w), `message '${e.message}' does not name '${w}'`);
    return true;
  });
}

const f32 = (a) => new Float32Array(a);

test('version, status names, CPU backend', () => {
  assert.equal(ks.version(), '0.1.0');
  assert.equal(ks.statusName(ks.Status.INVALID_ARGUMENT), 'KS_ERROR_INVALID_ARGUMENT');
  assert.equal(ks.backendAvailable('cpu'), true);
});

test('rms_norm matches fp64, in place, and bf16 bits', () => {
  const out = f32(10).fill(NaN);
  ks.rmsNorm(ks.f32(out, [2, 5]), ks.f32(f32(X), [2, 5]), ks.f32(f32(W)), 1e-6);
  assert.equal(ks.lastError(), '');
  assertClose(out, rmsNormRef(X, W, 1e-6), 1e-6, 'rms_norm');

  const x = f32(X);
  const xt = ks.f32(x, [2, 5]);
  ks.rmsNorm(xt, xt, { data: f32(W), shape: [5] }, 1e-6); // a plain object works as a tensor too
  assertClose(x, rmsNormRef(X, W, 1e-6), 1e-6, 'in place');

  // bf16 bits: the inputs are exact in bf16 (the upper halves of their fp32 bits).
  const bf = (a) => Uint16Array.from(new Uint32Array(f32(a).buffer), (b) => b >>> 16);
  const ob = new Uint16Array(10);
  ks.rmsNorm(ks.bf16(ob, [2, 5]), ks.bf16(bf(X), [2, 5]), ks.bf16(bf(W)), 1e-6);
  const got = new Float32Array(Uint32Array.from(ob, (b) => b << 16).buffer);
  assertClose(got, rmsNormRef(X, W, 1e-6), 1e-2, 'bf16 rms_norm');
});

test('softmax, silu_and_mul, gemv match fp64', () => {
  const out = f32(10).fill(NaN);
  ks.softmax(ks.f32(out, [2, 5]), ks.f32(f32(X), [2, 5]), { backend: 'cpu' });
  const ref = [];
  for (let r = 0; r < 2; r++) {
    const row = X.slice(r * 5, r * 5 + 5);
    const m = Math.max(...row);
    const sum = row.reduce((a, v) => a + Math.exp(v - m), 0);
    for (const v of row) ref.push(Math.exp(v - m) / sum);
  }
  assertClose(out, ref, 1e-6, 'softmax');

  const x2 = f32(20).map((_, i) => Math.fround(X[i % 10] * 0.75)); // [2, 2*5]: gate then up
  const s = f32(10);
  ks.siluAndMul(ks.f32(s, [2, 5]), ks.f32(x2, [2, 10]));
  const sref = [];
  for (let r = 0; r < 2; r++) {
    for (let i = 0; i < 5; i++) {
      const g = x2[r * 10 + i], u = x2[r * 10 + 5 + i];
      sref.push(g / (1 + Math.exp(-g)) * u);
    }
  }
  assertClose(s, sref, 1e-6, 'silu_and_mul');

  const g = f32(2);
  ks.gemv(ks.f32(g, [2]), ks.f32(f32(W), [5]), ks.f32(f32(X), [2, 5]));
  for (let n = 0; n < 2; n++) {
    let acc = 0, abs = 0;
    for (let h = 0; h < 5; h++) {
      const p = X[n * 5 + h] * W[h];
      acc += p;
      abs += Math.abs(p);
    }
    const tol = 1e-6 + 1e-6 * Math.abs(acc) + 8 * Math.sqrt(5) * 2 ** -24 * abs;
    assert.ok(Math.abs(g[n] - acc) <= tol, `gemv[${n}] = ${g[n]}, want ${acc}`);
  }
});

test('fused_add_rms_norm in place', () => {
  const x = f32(X);
  const res = f32(X.slice().reverse().map((v) => v * 0.5));
  const res0 = Array.from(res);
  ks.fusedAddRmsNorm(ks.f32(x, [2, 5]), ks.f32(res, [2, 5]), ks.f32(f32(W)), 1e-5);
  for (let r = 0; r < 2; r++) {
    const sum = [0, 1, 2, 3, 4].map((i) => X[r * 5 + i] + res0[r * 5 + i]);
    const scale = 1 / Math.sqrt(sum.reduce((a, v) => a + v * v, 0) / 5 + 1e-5);
    for (let i = 0; i < 5; i++) {
      assert.ok(close(res[r * 5 + i], sum[i], 1e-6), `residual[${r}][${i}]`);
      assert.ok(close(x[r * 5 + i], sum[i] * scale * W[i], 1e-6), `x[${r}][${i}]`);
    }
  }
});

test('invalid argument: eps = 0 names rms_norm and eps, out untouched', () => {
  const out = f32(10).fill(7);
  expectError(() => ks.rmsNorm(ks.f32(out, [2, 5]), ks.f32(f32(X), [2, 5]), ks.f32(f32(W)), 0, { backend: 'cpu' }),
              ks.Status.INVALID_ARGUMENT, 'rms_norm', 'eps');
  assert.ok(ks.lastError().includes('eps'));
  assert.deepEqual(Array.from(out), Array(10).fill(7));
});

test('unsupported dtype: fp64 x', () => {
  const out = f32(10).fill(7);
  expectError(() => ks.rmsNorm(ks.f32(out, [2, 5]), ks.tensor(new Float64Array(X), [2, 5]), ks.f32(f32(W)), 1e-6,
                               { backend: 'cpu' }),
              ks.Status.UNSUPPORTED_DTYPE, 'rms_norm', 'x');
  assert.deepEqual(Array.from(out), Array(10).fill(7));
});

test('unsupported device: weight claims CUDA; a success clears the error', () => {
  const out = f32(10).fill(7);
  expectError(() => ks.rmsNorm(ks.f32(out, [2, 5]), ks.f32(f32(X), [2, 5]), ks.f32(f32(W)).onDevice('cuda:0'), 1e-6,
                               { backend: 'cpu' }),
              ks.Status.UNSUPPORTED_DEVICE, 'rms_norm', 'weight');
  assert.deepEqual(Array.from(out), Array(10).fill(7));
  ks.softmax(ks.f32(out, [2, 5]), ks.f32(f32(X), [2, 5]), { backend: 'cpu' });
  assert.equal(ks.lastError(), '');
});

test('unknown variant and the registry', () => {
  assert.ok(ks.variants().length > 0);
  const c = ks.which('rms_norm', 'bf16', 'cpu');
  assert.equal(c.variant, 'cpu_reference');
  assert.ok(c.reason.length > 0);
  const rt = ks.routingTable();
  assert.equal(rt.schema, 'kernscope-routing-active/1');
  assert.ok(rt.files.includes('generic.json'));
  assert.ok(rt.cells.some((c) => c.op === 'quant_matmul' && c.backend === 'cpu' && c.order[0] === 'cpu_avx512'));
  expectError(() => ks.which('no_such_op', 'fp32', 'cpu'), ks.Status.INVALID_ARGUMENT, 'no_such_op');
  const s = ks.whichShape('quant_matmul', 'fp32', 1, 576, 'cpu');
  assert.ok(['cpu_avx512', 'cpu_reference'].includes(s.variant));
  assert.ok(s.reason.length > 0);
  expectError(() => ks.whichShape('quant_matmul', 'fp32', -1, 576, 'cpu'), ks.Status.INVALID_ARGUMENT, 'rows');
  // the weights' block format after the dtype (the routing cells bound to one); a bad one refused
  assert.ok(ks.whichShape('quant_matmul', 'fp32:q4_1', 1, 576, 'cpu').variant.startsWith('cpu_'));
  expectError(() => ks.whichShape('quant_matmul', 'fp32:q9_9', 1, 576, 'cpu'), ks.Status.INVALID_ARGUMENT, 'block format');
  expectError(() => ks.forceVariant('rms_norm', 'no_such_variant'), ks.Status.INVALID_ARGUMENT, 'rms_norm',
              'no_such_variant');
  const out = f32(10).fill(7);
  ks.rmsNorm(ks.f32(out, [2, 5]), ks.f32(f32(X), [2, 5]), ks.f32(f32(W)), 1e-6, { backend: 'cpu' });
  assert.equal(ks.forcedVariant('rms_norm'), null);
  ks.forceVariant('rms_norm', 'cpu_reference');
  assert.equal(ks.forcedVariant('rms_norm'), 'cpu_reference');
  expectError(() => ks.forcedVariant('no_such_op'), ks.Status.INVALID_ARGUMENT, 'no_such_op');
  ks.rmsNorm(ks.f32(out, [2, 5]), ks.f32(f32(X), [2, 5]), ks.f32(f32(W)), 1e-6, { backend: 'cpu' });
  ks.forceVariant(null, null);
  assert.deepEqual(ks.qtypeInfo('q4_1'), { blockSize: 32, blockBytes: 20 });
  assert.equal(ks.lastLaunchConfig('rms_norm'), '');
  assert.equal(ks.opRunsVariantsOf('paged_attention_after_append'), 'paged_attention');
  assert.equal(ks.opRunsVariantsOf('rms_norm'), null);
  assert.ok(ks.opColsFactors('quant_matmul').startsWith('N x K'));
  assert.ok(ks.opColsFactors('paged_attention_after_append').startsWith('max_blocks_per_seq x block_size'));
  assert.equal(ks.opColsFactors('softmax'), null);
});

test('argmax (int64 out) and embedding ids', () => {
  const idx = new BigInt64Array(2).fill(-1n);
  ks.argmax(ks.i64(idx), ks.f32(f32(X), [2, 5]));
  assert.deepEqual(Array.from(idx), [3n, 3n]);
  const table = f32([1, 2, 3, 4, 5, 6]);
  const out = f32(4);
  ks.embedding(ks.f32(out, [2, 2]), ks.i32(new Int32Array([2, 0])), ks.f32(table, [3, 2]), 'none');
  assert.deepEqual(Array.from(out), [5, 6, 1, 2]);
  expectError(() => ks.embedding(ks.f32(out, [2, 2]), ks.i64(new BigInt64Array([1n, 3n])), ks.f32(table, [3, 2])),
              ks.Status.INVALID_ARGUMENT, 'embedding');
  assert.deepEqual(Array.from(out), [5, 6, 1, 2]);
});

test('views are checked against their typed arrays', () => {
  const out = f32(15).fill(7);
  expectError(() => ks.softmax(ks.f32(out, [3, 5]), ks.f32(f32(X), [3, 5])), ks.Status.INVALID_ARGUMENT, 'softmax', 'x');
  expectError(() => ks.softmax(ks.f32(out, [2, 5]), ks.f32(f32(X), [2, 5]).withStrides([5, 2])),
              ks.Status.INVALID_ARGUMENT, 'softmax', 'x');
  expectError(() => ks.softmax(ks.f32(out, [2, 5]), ks.tensor(f32(X), [2, 5], { byteOffset: 4 })),
              ks.Status.INVALID_ARGUMENT, 'softmax', 'x');
  // Non-compact strides inside the array reach the library, which rejects them.
  expectError(() => ks.softmax(ks.f32(out.subarray(0, 4), [2, 2]), ks.f32(f32(X), [2, 2]).withStrides([5, 1])),
              ks.Status.INVALID_ARGUMENT, 'softmax');
  assert.deepEqual(Array.from(out), Array(15).fill(7));
  // A subarray is an offset view: its own byteOffset into the buffer is honoured.
  const big = f32([0, 0, 0, ...X]);
  const o2 = f32(10);
  ks.softmax(ks.f32(o2, [2, 5]), ks.f32(big.subarray(3), [2, 5]));
  const o3 = f32(10);
  ks.softmax(ks.f32(o3, [2, 5]), ks.f32(f32(X), [2, 5]));
  assert.deepEqual(Array.from(o2), Array.from(o3));
  assert.throws(() => ks.tensor(new Uint16Array(4), [4]), TypeError);
  assert.throws(() => ks.tensor(new Float32Array(4), [4], { dtype: 'fp16' }), TypeError);
  assert.throws(() => ks.rmsNorm(out, out, out, 1e-6), TypeError);
});

test('device pointers (BigInt) reach the library: CPU backend rejects them, no CUDA is unavailable', () => {
  // Bogus addresses: every call here is rejected before any memory is touched.
  const p = ks.devicePtr(0x10000n, 'fp32', [2, 5]);
  const w = ks.devicePtr(0x20000n, 'fp32', [5]);
  assert.deepEqual(p.device, { type: 'cuda', id: 0 });
  expectError(() => ks.rmsNorm(p, p, w, 1e-6, { backend: 'cpu' }), ks.Status.UNSUPPORTED_DEVICE, 'rms_norm');
  if (!ks.backendAvailable('cuda')) {
    expectError(() => ks.rmsNorm(p, p, w, 1e-6, { backend: 'cuda', stream: 0n }), ks.Status.BACKEND_UNAVAILABLE,
                'rms_norm');
  }
});

test('sample: top-k 1 is argmax; a NaN row is flagged invalid', () => {
  const idx = new BigInt64Array(2).fill(-1n);
  const valid = new Uint8Array(2).fill(9);
  const so = ks.i64(new BigInt64Array([7n, 1n]));
  ks.sample(ks.i64(idx), ks.u8(valid, [2]), ks.f32(f32(X), [2, 5]), so, 1.0, 1, 1.0);
  assert.deepEqual(Array.from(idx), [3n, 3n]);
  assert.deepEqual(Array.from(valid), [1, 1]);
  const nan = f32(X);
  nan[6] = NaN;
  ks.sample(ks.i64(idx), ks.u8(valid, [2]), ks.f32(nan, [2, 5]), so, 0.8, 0, 0.9);
  assert.equal(idx[1], 0n);
  assert.deepEqual(Array.from(valid), [1, 0]);
  expectError(() => ks.sample(ks.i64(idx), null, ks.f32(f32(X), [2, 5]), so, 0, 0, 1), ks.Status.INVALID_ARGUMENT, 'sample');
});

// ---- the quant_matmul fusions -----------------------------------------------------------------

// Q8_0 rows built here: per 32-element block an f16 scale d (1/16, 2/16 or 3/16, exact in f16) then
// 32 int8 codes q; element = d * q. Returns the packed bytes [n, k/32*34] and the values [n, k].
function q80Rows(n, k) {
  const scales = [[0x2c00, 0.0625], [0x3000, 0.125], [0x3200, 0.1875]];
  const packed = new Uint8Array(n * (k / 32) * 34);
  const values = new Float64Array(n * k);
  let p = 0;
  for (let r = 0; r < n; r++) {
    for (let b = 0; b < k / 32; b++) {
      const [bits, d] = scales[(r + b) % 3];
      packed[p++] = bits & 0xff;
      packed[p++] = bits >> 8;
      for (let j = 0; j < 32; j++) {
        const q = ((r * 7 + b * 13 + j * 5) % 41) - 20;
        packed[p++] = q & 0xff;
        values[r * k + b * 32 + j] = d * q;
      }
    }
  }
  return { packed, values };
}

// out [m, n] against FP64 h @ w^T, allowing rel*|h| per element of h (its FP32 computation) and
// the FP32 sum in any order.
function checkMatmul(what, out, h, w, m, n, k, rel) {
  for (let i = 0; i < m; i++) {
    for (let j = 0; j < n; j++) {
      let acc = 0, abs = 0;
      for (let c = 0; c < k; c++) {
        const p = h[i * k + c] * w[j * k + c];
        acc += p;
        abs += Math.abs(p);
      }
      const tol = 1e-6 + 1e-6 * Math.abs(acc) + (rel + 8 * Math.sqrt(k) * 2 ** -24) * abs;
      assert.ok(Math.abs(out[i * n + j] - acc) <= tol, `${what}[${i}][${j}] = ${out[i * n + j]}, want ${acc}`);
    }
  }
}

test('fused_add_rms_norm_quant_matmul matches fp64; residual_out without x is rejected', () => {
  const m = 2, n = 3, k = 64, eps = 1e-5;
  const { packed, values } = q80Rows(n, k);
  const w = ks.u8(packed, [n, (k / 32) * 34]);
  const x = f32(m * k).map((_, i) => X[i % 10] * (1 + i / 64));
  const res = f32(m * k).map((_, i) => X[(i * 3 + 1) % 10] * 0.5);
  const nw = f32(k).map((_, i) => W[i % 5] + 0.125);
  const norm = (s) => {
    const h = new Float64Array(s.length);
    for (let r = 0; r < m; r++) {
      let ss = 0;
      for (let c = 0; c < k; c++) ss += s[r * k + c] * s[r * k + c];
      const scale = 1 / Math.sqrt(ss / k + eps);
      for (let c = 0; c < k; c++) h[r * k + c] = s[r * k + c] * scale * nw[c];
    }
    return h;
  };
  const rel = (8 * Math.sqrt(k) + 16) * 2 ** -24;

  // with x: residual_out = x + residual; out = quant_matmul(rms_norm(x + residual))
  const out = f32(m * n).fill(NaN), resOut = f32(m * k).fill(NaN);
  ks.fusedAddRmsNormQuantMatmul(ks.f32(out, [m, n]), ks.f32(resOut, [m, k]), ks.f32(x, [m, k]), ks.f32(res, [m, k]),
                                ks.f32(nw), eps, w, 'q8_0', { backend: 'cpu' });
  const s = Array.from(x, (v, i) => v + res[i]);
  for (let i = 0; i < s.length; i++) assert.equal(resOut[i], Math.fround(s[i]), `residual_out[${i}]`);
  checkMatmul('out', out, norm(s), values, m, n, k, rel);

  // x null: out = quant_matmul(rms_norm(residual))
  const out0 = f32(m * n).fill(NaN);
  ks.fusedAddRmsNormQuantMatmul(ks.f32(out0, [m, n]), null, null, ks.f32(res, [m, k]), ks.f32(nw), eps, w, 'q8_0');
  checkMatmul('out (no x)', out0, norm(Array.from(res)), values, m, n, k, rel);

  const out7 = f32(m * n).fill(7), res7 = f32(m * k).fill(7);
  expectError(() => ks.fusedAddRmsNormQuantMatmul(ks.f32(out7, [m, n]), ks.f32(res7, [m, k]), null, ks.f32(res, [m, k]),
                                                  ks.f32(nw), eps, w, 'q8_0', { backend: 'cpu' }),
              ks.Status.INVALID_ARGUMENT, 'fused_add_rms_norm_quant_matmul', 'residual_out');
  assert.ok(out7.every((v) => v === 7) && res7.every((v) => v === 7));
});

test('silu_and_mul_quant_matmul matches fp64; an odd gate_up width is rejected', () => {
  const m = 2, n = 3, k = 64;
  const { packed, values } = q80Rows(n, k);
  const w = ks.u8(packed, [n, (k / 32) * 34]);
  const gu = f32(m * 2 * k).map((_, i) => X[(i * 7) % 10] * 0.75 + (i % 3) * 0.25);
  const h = new Float64Array(m * k);
  for (let r = 0; r < m; r++) {
    for (let c = 0; c < k; c++) {
      const g = gu[r * 2 * k + c], u = gu[r * 2 * k + k + c];
      h[r * k + c] = g / (1 + Math.exp(-g)) * u;
    }
  }
  const out = f32(m * n).fill(NaN);
  ks.siluAndMulQuantMatmul(ks.f32(out, [m, n]), ks.f32(gu, [m, 2 * k]), w, 'q8_0', { backend: 'cpu' });
  checkMatmul('out', out, h, values, m, n, k, 16 * 2 ** -24);

  const out7 = f32(m * n).fill(7);
  expectError(() => ks.siluAndMulQuantMatmul(ks.f32(out7, [m, n]), ks.f32(gu.subarray(0, m * 127), [m, 127]), w, 'q8_0'),
              ks.Status.INVALID_ARGUMENT, 'silu_and_mul_quant_matmul', 'gate_up');
  assert.ok(out7.every((v) => v === 7));
});

// ---- quant_matmul_a8 ------------------------------------------------------------------------------

// x quantized per block of 32 as docs/contracts.md#quant_matmul_a8 writes it, each step one float32
// rounding (Math.fround): d per block (NaN for a block holding a NaN or an infinity, 0 when
// d < FLT_MIN) and the codes q.
function a8Quantize(x) {
  const d = [], q = [];
  const rintEven = (t) => {
    const f = Math.floor(t), r = t - f;
    return r < 0.5 ? f : r > 0.5 ? f + 1 : (f % 2 === 0 ? f : f + 1);
  };
  for (let b = 0; b < x.length; b += 32) {
    const blk = Array.from(x.subarray(b, b + 32));
    const bad = blk.some((v) => !Number.isFinite(v));
    const amax = blk.reduce((a, v) => (Number.isFinite(v) ? Math.max(a, Math.abs(v)) : a), 0);
    const db = Math.fround(amax / 127);
    if (bad || !(db >= 2 ** -126)) {
      d.push(bad ? NaN : 0);
      for (let i = 0; i < 32; i++) q.push(0);
      continue;
    }
    const inv = Math.fround(127 / amax);
    d.push(db);
    for (const v of blk) q.push(Math.max(-127, Math.min(127, rintEven(Math.fround(v * inv)))));
  }
  return { d, q };
}

test('quant_matmul_a8 matches the contract; a dense qtype is rejected naming qtype', () => {
  const m = 3, n = 3, k = 64;
  const { packed, values } = q80Rows(n, k);
  const w = ks.u8(packed, [n, (k / 32) * 34]);
  const x = f32(m * k).map((_, i) => X[(i * 3) % 10] * (1 + (i % 7) * 0.375));
  x.set([127, 0.5, 1.5, 2.5, -2.5]); // row 0, block 0 at d = 1: ties go to even codes 0, 2, 2, -2
  x[2 * k + 40] = NaN; // row 2: a NaN in block 1 makes every output of the row NaN
  const { d, q } = a8Quantize(x);
  const out = f32(m * n).fill(NaN), exact = f32(m * n).fill(NaN);
  ks.quantMatmulA8(ks.f32(out, [m, n]), ks.f32(x, [m, k]), w, 'q8_0', { backend: 'cpu' });
  ks.quantMatmul(ks.f32(exact, [m, n]), ks.f32(x, [m, k]), w, 'q8_0');
  for (let i = 0; i < m; i++) {
    for (let j = 0; j < n; j++) {
      const g = out[i * n + j];
      if (i === 2) {
        assert.ok(Number.isNaN(g), `row 2 (NaN in x): out[2][${j}] = ${g}`);
        continue;
      }
      let acc = 0, abs = 0, halfStep = 0;
      for (let c = 0; c < k; c++) {
        const db = d[(i * k + c) >> 5];
        const p = values[j * k + c] * db * q[i * k + c];
        acc += p;
        abs += Math.abs(p);
        halfStep += Math.abs(values[j * k + c]) * db / 2;
      }
      const tol = 1e-6 + 1e-6 * Math.abs(acc) + (k / 32 + 10) * 2 ** -24 * abs;
      assert.ok(Math.abs(g - acc) <= tol, `out[${i}][${j}] = ${g}, want ${acc}`);
      // quantMatmul of the unquantized x: at most half a code step per element away
      const e = exact[i * n + j];
      assert.ok(Math.abs(g - e) <= halfStep * 1.0001 + 1e-5 * (1 + Math.abs(e)), `out ${g} vs quantMatmul ${e}`);
    }
  }

  const out7 = f32(m * n).fill(7);
  expectError(() => ks.quantMatmulA8(ks.f32(out7, [m, n]), ks.f32(x, [m, k]), ks.u8(new Uint8Array(n * k * 2), [n, k * 2]),
                                     'f16'),
              ks.Status.INVALID_ARGUMENT, 'quant_matmul_a8', 'qtype');
  assert.ok(out7.every((v) => v === 7));
});

// ---- rotary_embedding_kv_append -------------------------------------------------------------------

// q [3, 2, 8], k and v [3, 1, 8], caches [2 blocks, 2 slots, 1, 8] (filled, so untouched rows are
// compared too).
function ropeKvInputs() {
  return {
    q: f32(48).map((_, i) => X[i % 10] * (1 + i / 16)),
    k: f32(24).map((_, i) => X[(i * 3 + 1) % 10] - 0.25 * i),
    v: f32(24).map((_, i) => W[i % 5] * i),
    kc: f32(32).map((_, i) => -i),
    vc: f32(32).map((_, i) => 100 + i),
  };
}

const bits = (a) => Array.from(new Uint32Array(a.buffer, a.byteOffset, a.length));

test('rotary_embedding_kv_append is bit for bit rotary_embedding then kv_cache_append', () => {
  const pos = ks.i32(new Int32Array([0, 5, 100]));
  const slots = ks.i64(new BigInt64Array([2n, -1n, 0n])); // slot -1 skipped
  for (const neox of [true, false]) {
    const a = ropeKvInputs(), b = ropeKvInputs();
    // rotary_dim 4 < head_dim 8: features 4..8 pass through
    ks.rotaryEmbeddingKvAppend(ks.f32(a.q, [3, 2, 8]), ks.f32(a.k, [3, 1, 8]), ks.f32(a.v, [3, 1, 8]), pos, 4, 10000,
                               neox, ks.f32(a.kc, [2, 2, 1, 8]), ks.f32(a.vc, [2, 2, 1, 8]), slots, { backend: 'cpu' });
    ks.rotaryEmbedding(ks.f32(b.q, [3, 2, 8]), ks.f32(b.k, [3, 1, 8]), pos, 4, 10000, neox);
    ks.kvCacheAppend(ks.f32(b.kc, [2, 2, 1, 8]), ks.f32(b.vc, [2, 2, 1, 8]), ks.f32(b.k, [3, 1, 8]),
                     ks.f32(b.v, [3, 1, 8]), slots);
    for (const name of ['q', 'k', 'kc', 'vc']) assert.deepEqual(bits(a[name]), bits(b[name]), `${name} (neox ${neox})`);
    // the call did something: slot 2 holds token 0's rotated k, slot 0 token 2's v
    assert.deepEqual(bits(a.kc.subarray(16, 24)), bits(a.k.subarray(0, 8)));
    assert.deepEqual(bits(a.vc.subarray(0, 8)), bits(a.v.subarray(16, 24)));
    assert.notDeepEqual(bits(a.q.subarray(16, 20)), bits(ropeKvInputs().q.subarray(16, 20)));
  }
});

test('rotary_embedding_kv_append: v overlapping k is rejected, nothing written', () => {
  const a = ropeKvInputs(), before = ropeKvInputs();
  const k = ks.f32(a.k, [3, 1, 8]);
  expectError(() => ks.rotaryEmbeddingKvAppend(ks.f32(a.q, [3, 2, 8]), k, k, ks.i64(new BigInt64Array([0n, 1n, 2n])), 8,
                                               10000, true, ks.f32(a.kc, [2, 2, 1, 8]), ks.f32(a.vc, [2, 2, 1, 8]),
                                               ks.i32(new Int32Array([0, 1, 3])), { backend: 'cpu' }),
              ks.Status.INVALID_ARGUMENT, 'rotary_embedding_kv_append', 'v and k overlap');
  for (const name of ['q', 'k', 'kc', 'vc']) assert.deepEqual(bits(a[name]), bits(before[name]), name);
  assert.throws(() => ks.rotaryEmbeddingKvAppend(ks.f32(a.q, [3, 2, 8]), null, k, ks.i32(new Int32Array(3)), 8, 10000,
                                                 true, ks.f32(a.kc, [2, 2, 1, 8]), ks.f32(a.vc, [2, 2, 1, 8]),
                                                 ks.i32(new Int32Array(3))), TypeError);
});

// ---- fused_add_rms_norm_quant_matmul_rope_kv_append ---------------------------------------------

// One token: H = 2, KVH = 1, D = 8 (out [1, 32] = q | k | v), K = 64 (Q8_0 weight [32, 68]), caches
// [2 blocks, 2 slots, 1, 8] (filled, so untouched rows are compared too).
function normRopeInputs() {
  return {
    w: ks.u8(q80Rows(32, 64).packed, [32, 68]),
    x: f32(64).map((_, i) => X[i % 10] * (1 + i / 64)),
    res: f32(64).map((_, i) => X[(i * 3 + 1) % 10] * 0.5),
    nw: f32(64).map((_, i) => W[i % 5] + 0.125),
    kc: f32(32).map((_, i) => -i),
    vc: f32(32).map((_, i) => 100 + i),
  };
}

test('fused_add_rms_norm_quant_matmul_rope_kv_append is bit for bit the norm matmul then rotary_embedding_kv_append', () => {
  const H = 2, KVH = 1, D = 8;
  const pos = ks.i32(new Int32Array([5]));
  const slots = ks.i64(new BigInt64Array([3n])); // block 1, offset 1
  for (const withX of [true, false]) {
    for (const neox of [true, false]) {
      const a = normRopeInputs(), b = normRopeInputs();
      for (const t of [a, b]) Object.assign(t, { out: f32(32).fill(NaN), resOut: f32(64).fill(NaN) });
      // rotary_dim 4 < head_dim 8: features 4..8 pass through
      ks.fusedAddRmsNormQuantMatmulRopeKvAppend(ks.f32(a.out, [1, 32]), withX ? ks.f32(a.resOut, [1, 64]) : null,
                                                withX ? ks.f32(a.x, [1, 64]) : null, ks.f32(a.res, [1, 64]),
                                                ks.f32(a.nw), 1e-5, a.w, 'q8_0', H, KVH, pos, 4, 10000, neox,
                                                ks.f32(a.kc, [2, 2, 1, 8]), ks.f32(a.vc, [2, 2, 1, 8]), slots,
                                                { backend: 'cpu' });
      // the two calls: the norm + matmul into b.out, then RoPE + append on its column slices
      ks.fusedAddRmsNormQuantMatmul(ks.f32(b.out, [1, 32]), withX ? ks.f32(b.resOut, [1, 64]) : null,
                                    withX ? ks.f32(b.x, [1, 64]) : null, ks.f32(b.res, [1, 64]), ks.f32(b.nw), 1e-5,
                                    b.w, 'q8_0');
      const plain = b.out.slice();
      ks.rotaryEmbeddingKvAppend(ks.f32(b.out.subarray(0, H * D), [1, H, D]),
                                 ks.f32(b.out.subarray(H * D, (H + KVH) * D), [1, KVH, D]),
                                 ks.f32(b.out.subarray((H + KVH) * D), [1, KVH, D]), pos, 4, 10000, neox,
                                 ks.f32(b.kc, [2, 2, 1, 8]), ks.f32(b.vc, [2, 2, 1, 8]), slots);
      const what = `(x ${withX}, neox ${neox})`;
      for (const name of ['out', 'resOut', 'kc', 'vc']) assert.deepEqual(bits(a[name]), bits(b[name]), `${name} ${what}`);
      // the call did something: q rotated, slot 3 holds the rotated k and v, the rest kept
      assert.notDeepEqual(bits(a.out.subarray(0, 4)), bits(plain.subarray(0, 4)), `q rotated ${what}`);
      assert.deepEqual(bits(a.kc.subarray(24, 32)), bits(a.out.subarray(16, 24)), `k_cache slot 3 ${what}`);
      assert.deepEqual(bits(a.vc.subarray(24, 32)), bits(a.out.subarray(24, 32)), `v_cache slot 3 ${what}`);
      assert.deepEqual(bits(a.kc.subarray(0, 24)), bits(normRopeInputs().kc.subarray(0, 24)), `other slots ${what}`);
      assert.equal(a.resOut.every((v) => Number.isNaN(v)), !withX, `residual_out written ${what}`);
    }
  }
});

test('fused_add_rms_norm_quant_matmul_rope_kv_append: num_heads 0 is rejected, nothing written', () => {
  const a = normRopeInputs(), before = normRopeInputs();
  const out = f32(32).fill(7), resOut = f32(64).fill(7);
  expectError(() => ks.fusedAddRmsNormQuantMatmulRopeKvAppend(ks.f32(out, [1, 32]), ks.f32(resOut, [1, 64]),
                                                              ks.f32(a.x, [1, 64]), ks.f32(a.res, [1, 64]),
                                                              ks.f32(a.nw), 1e-5, a.w, 'q8_0', 0, 1,
                                                              ks.i64(new BigInt64Array([5n])), 8, 10000, false,
                                                              ks.f32(a.kc, [2, 2, 1, 8]), ks.f32(a.vc, [2, 2, 1, 8]),
                                                              ks.i32(new Int32Array([3])), { backend: 'cpu' }),
              ks.Status.INVALID_ARGUMENT, 'fused_add_rms_norm_quant_matmul_rope_kv_append', 'num_heads');
  assert.ok(out.every((v) => v === 7) && resOut.every((v) => v === 7));
  for (const name of ['kc', 'vc']) assert.deepEqual(bits(a[name]), bits(before[name]), name);
});

// ---- rotary_embedding_kv_append_paged_attention ---------------------------------------------------

// n pseudo-random values in [-2, 2) from a fixed seed (a 32-bit LCG).
function randomF32(n, seed) {
  let s = (seed * 2654435761) >>> 0;
  return f32(n).map(() => {
    s = (Math.imul(s, 1664525) + 1013904223) >>> 0;
    return (s / 2 ** 32) * 4 - 2;
  });
}

// q [3, 6, 8], k and v [3, 2, 8] (GQA: 6 query heads, 2 kv heads), caches [6 blocks, 2 slots, 2, 8],
// random (so untouched cache rows are compared too).
function ropeAttnInputs(seed) {
  return {
    q: randomF32(3 * 6 * 8, seed), k: randomF32(3 * 2 * 8, seed + 1), v: randomF32(3 * 2 * 8, seed + 2),
    kc: randomF32(6 * 2 * 2 * 8, seed + 3), vc: randomF32(6 * 2 * 2 * 8, seed + 4),
  };
}

test('rotary_embedding_kv_append_paged_attention is bit for bit rotary_embedding_kv_append then paged_attention', () => {
  const T = 3, H = 6, KVH = 2, D = 8, RD = 4, theta = 10000, scale = 0.35;
  const cases = [
    // a decode step: token t is the newest position (context_lens[t] - 1) of sequence t
    { name: 'decode, seqIds null', pos: ks.i32(new Int32Array([2, 0, 3])), slots: [0, 2, 5],
      bt: ks.i32(new Int32Array([4, 0, 1, 5, 3, 2]), [3, 2]), seq: null, ctx: ks.i32(new Int32Array([3, 1, 4])) },
    // tokens 0 and 1 of sequence 1 (token 1 reads the slot token 0 appends), token 2 of sequence 0
    { name: 'prefill chunk, seqIds given', pos: ks.i64(new BigInt64Array([1n, 2n, 0n])), slots: [11, 2, 6],
      bt: ks.i32(new Int32Array([3, 2, 5, 1]), [2, 2]), seq: ks.i32(new Int32Array([1, 1, 0])),
      ctx: ks.i32(new Int32Array([2, 3, 1])) },
  ];
  cases.forEach((c, ci) => {
    for (const neox of [true, false]) {
      const what = `(${c.name}, neox ${neox})`;
      const a = ropeAttnInputs(10 + 5 * ci), b = ropeAttnInputs(10 + 5 * ci), orig = ropeAttnInputs(10 + 5 * ci);
      a.out = f32(T * H * D).fill(NaN);
      b.out = f32(T * H * D).fill(NaN);
      const slots = ks.i64(BigInt64Array.from(c.slots, BigInt));
      ks.rotaryEmbeddingKvAppendPagedAttention(ks.f32(a.out, [T, H, D]), ks.f32(a.q, [T, H, D]), ks.f32(a.k, [T, KVH, D]),
                                               ks.f32(a.v, [T, KVH, D]), c.pos, RD, theta, neox,
                                               ks.f32(a.kc, [6, 2, KVH, D]), ks.f32(a.vc, [6, 2, KVH, D]), slots, c.bt,
                                               c.seq, c.ctx, scale, { backend: 'cpu' });
      // the two calls on copies of the inputs
      ks.rotaryEmbeddingKvAppend(ks.f32(b.q, [T, H, D]), ks.f32(b.k, [T, KVH, D]), ks.f32(b.v, [T, KVH, D]), c.pos, RD,
                                 theta, neox, ks.f32(b.kc, [6, 2, KVH, D]), ks.f32(b.vc, [6, 2, KVH, D]), slots,
                                 { backend: 'cpu' });
      ks.pagedAttention(ks.f32(b.out, [T, H, D]), ks.f32(b.q, [T, H, D]), ks.f32(b.kc, [6, 2, KVH, D]),
                        ks.f32(b.vc, [6, 2, KVH, D]), c.bt, c.seq, c.ctx, scale, { backend: 'cpu' });
      for (const name of ['out', 'q', 'k', 'kc', 'vc']) assert.deepEqual(bits(a[name]), bits(b[name]), `${name} ${what}`);
      // the call did something: every out value written, q rotated (features past rotary_dim kept), the
      // slots hold the rotated k and v, the other cache rows untouched
      assert.ok(a.out.every((v) => !Number.isNaN(v)), `out written ${what}`);
      assert.notDeepEqual(bits(a.q.subarray(0, RD)), bits(orig.q.subarray(0, RD)), `q of token 0 rotated ${what}`);
      assert.deepEqual(bits(a.q.subarray(RD, D)), bits(orig.q.subarray(RD, D)), `q past rotary_dim ${what}`);
      const row = KVH * D;
      for (let slot = 0; slot < 12; slot++) {
        const t = c.slots.indexOf(slot);
        const cached = (x) => bits(x.subarray(slot * row, (slot + 1) * row));
        if (t >= 0) {
          assert.deepEqual(cached(a.kc), bits(a.k.subarray(t * row, (t + 1) * row)), `k_cache[${slot}] ${what}`);
          assert.deepEqual(cached(a.vc), bits(a.v.subarray(t * row, (t + 1) * row)), `v_cache[${slot}] ${what}`);
        } else {
          assert.deepEqual(cached(a.kc), cached(orig.kc), `k_cache[${slot}] kept ${what}`);
        }
      }
    }
  });
});

test('rotary_embedding_kv_append_paged_attention: out overlapping v is rejected, nothing written', () => {
  const T = 3, H = 6, KVH = 2, D = 8;
  const a = ropeAttnInputs(20), before = ropeAttnInputs(20);
  const buf = f32(T * H * D).fill(7); // out; its first T * KVH * D values are also v
  const args = (out, v, ctx) => [ks.f32(out, [T, H, D]), ks.f32(a.q, [T, H, D]), ks.f32(a.k, [T, KVH, D]),
    ks.f32(v, [T, KVH, D]), ks.i32(new Int32Array([2, 0, 3])), 4, 10000, true, ks.f32(a.kc, [6, 2, KVH, D]),
    ks.f32(a.vc, [6, 2, KVH, D]), ks.i64(new BigInt64Array([0n, 2n, 5n])),
    ks.i32(new Int32Array([4, 0, 1, 5, 3, 2]), [3, 2]), null, ks.i32(new Int32Array(ctx)), 0.35, { backend: 'cpu' }];
  expectError(() => ks.rotaryEmbeddingKvAppendPagedAttention(...args(buf, buf.subarray(0, T * KVH * D), [3, 1, 4])),
              ks.Status.INVALID_ARGUMENT, 'rotary_embedding_kv_append_paged_attention', 'out and v overlap');
  // context_lens[1] = 5 > max_blocks_per_seq * block_size = 4
  expectError(() => ks.rotaryEmbeddingKvAppendPagedAttention(...args(buf, a.v, [3, 5, 4])),
              ks.Status.INVALID_ARGUMENT, 'rotary_embedding_kv_append_paged_attention', 'context_lens[1] = 5');
  assert.ok(buf.every((v) => v === 7));
  for (const name of ['q', 'k', 'kc', 'vc']) assert.deepEqual(bits(a[name]), bits(before[name]), name);
  const noK = args(buf, a.v, [3, 1, 4]);
  noK[2] = null;
  assert.throws(() => ks.rotaryEmbeddingKvAppendPagedAttention(...noK), TypeError);
});

// ---- paged_attention_after_append -------------------------------------------------------------------

test('paged_attention_after_append is bit for bit paged_attention for fresh_keys 0 and 1', () => {
  const T = 3, H = 6, KVH = 2, D = 8, scale = 0.35;
  const a = ropeAttnInputs(30);
  const bt = ks.i32(new Int32Array([4, 0, 1, 5, 3, 2]), [3, 2]), ctx = ks.i32(new Int32Array([3, 1, 4]));
  for (const seq of [null, ks.i32(new Int32Array([2, 0, 1]))]) {
    const want = f32(T * H * D).fill(NaN);
    ks.pagedAttention(ks.f32(want, [T, H, D]), ks.f32(a.q, [T, H, D]), ks.f32(a.kc, [6, 2, KVH, D]),
                      ks.f32(a.vc, [6, 2, KVH, D]), bt, seq, ctx, scale, { backend: 'cpu' });
    assert.ok(want.every((v) => !Number.isNaN(v)));
    for (const fresh of [0, 1, 1n]) {
      const out = f32(T * H * D).fill(NaN);
      ks.pagedAttentionAfterAppend(ks.f32(out, [T, H, D]), ks.f32(a.q, [T, H, D]), ks.f32(a.kc, [6, 2, KVH, D]),
                                   ks.f32(a.vc, [6, 2, KVH, D]), bt, seq, ctx, scale, fresh, { backend: 'cpu' });
      assert.deepEqual(bits(out), bits(want), `fresh_keys ${fresh}, seqIds ${seq ? 'given' : 'null'}`);
    }
  }
});

test('paged_attention_after_append: fresh_keys -1 is rejected, nothing written', () => {
  const T = 3, H = 6, KVH = 2, D = 8;
  const a = ropeAttnInputs(31);
  const out = f32(T * H * D).fill(7);
  expectError(() => ks.pagedAttentionAfterAppend(ks.f32(out, [T, H, D]), ks.f32(a.q, [T, H, D]),
                                                 ks.f32(a.kc, [6, 2, KVH, D]), ks.f32(a.vc, [6, 2, KVH, D]),
                                                 ks.i32(new Int32Array([4, 0, 1, 5, 3, 2]), [3, 2]), null,
                                                 ks.i32(new Int32Array([3, 1, 4])), 0.35, -1),
              ks.Status.INVALID_ARGUMENT, 'paged_attention_after_append', 'fresh_keys');
  assert.ok(out.every((v) => v === 7));
  // not an integer: named before the library is called
  assert.throws(() => ks.pagedAttentionAfterAppend(ks.f32(out, [T, H, D]), ks.f32(a.q, [T, H, D]),
                                                   ks.f32(a.kc, [6, 2, KVH, D]), ks.f32(a.vc, [6, 2, KVH, D]),
                                                   ks.i32(new Int32Array([4, 0, 1, 5, 3, 2]), [3, 2]), null,
                                                   ks.i32(new Int32Array([3, 1, 4])), 0.35, 0.5),
                /fresh_keys must be an integer/);
});
