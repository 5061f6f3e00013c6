//! Runs a [`Plan`] on the GPU: one device arena per executable, kernels launched step by step on
//! the device's stream; decode plans are captured once per KV cache as a CUDA graph and replayed.

use std::sync::Arc;

use cudarc::driver::{sys, CudaGraph};
use kiln_ir::DType;
use kiln_runtime::{Executable, HostData, HostTensor, Kernel, KvCache, Plan, Rows, RuntimeError, Slot, StepInputs};

use crate::device::{cuda_err, Arg, Device, DeviceBuffer, Scratch};
use crate::kv::CudaKvCache;
use crate::weights::{format_name, CudaWeights};

/// Most activation rows the matrix-vector kernels take (more rows go through cuBLAS).
const MATVEC_ROWS: usize = 8;
/// Blocks of the first argmax phase per row.
const ARGMAX_BLOCKS: usize = 64;

/// A captured decode step, for the KV cache whose addresses it bakes in.
struct CapturedStep {
    kv_id: u64,
    graph: CudaGraph,
}

// SAFETY: the graph is launched only by its executable, under the device lock.
unsafe impl Send for CapturedStep {}

/// A plan bound to the device's weights, with its own arena and step buffer.
pub struct CudaExecutable {
    plan: Arc<Plan>,
    weights: Arc<CudaWeights>,
    device: Arc<Device>,
    arena: DeviceBuffer,
    /// `[start, rows, token ids...]`, written before each step.
    step: DeviceBuffer,
    /// Full products of greedy heads and the argmax partials (per executable: graphs bake them in).
    head: DeviceBuffer,
    head_values: usize,
    /// Vocabulary of the embedding (token ids are checked against it).
    vocab: usize,
    graph: Option<CapturedStep>,
    use_graphs: bool,
}

/// Rows of a step that runs over `active` rows.
fn rows_of(rows: Rows, active: usize) -> usize {
    match rows {
        Rows::Active => active,
        Rows::One => 1,
    }
}

impl CudaExecutable {
    /// Binds `plan` to `weights`, checking every kernel and weight it uses.
    pub(crate) fn new(plan: Arc<Plan>, weights: Arc<CudaWeights>, use_graphs: bool) -> Result<Self, RuntimeError> {
        let device = weights.device.clone();
        let mut head_values = 0;
        let mut vocab = usize::MAX;
        for step in &plan.steps {
            #[allow(unreachable_patterns)]
            match &step.kernel {
                Kernel::Embed { table, .. } => vocab = vocab.min(weights.matrix(*table)?.n),
                Kernel::MatMul { w, .. } => {
                    weights.matrix(*w)?;
                }
                Kernel::MatMulArgmax { w, .. } => {
                    let n = weights.matrix(*w)?.n;
                    head_values = head_values.max(rows_of(step.rows, plan.rows()) * n);
                }
                Kernel::RmsNorm { weight, .. } => {
                    weights.vector(*weight)?;
                }
                Kernel::Attention { head_dim, q_heads, kv_heads, .. } => {
                    if *head_dim > 256 || !head_dim.is_multiple_of(32) || *kv_heads == 0 || !q_heads.is_multiple_of(*kv_heads) {
                        return Err(cuda_err(format!(
                            "attention with head size {head_dim}, {q_heads} query / {kv_heads} key heads is not supported (head size must be a multiple of 32, at most 256)"
                        )));
                    }
                }
                Kernel::Rope { .. }
                | Kernel::Add { .. }
                | Kernel::Mul { .. }
                | Kernel::Gelu { .. }
                | Kernel::GeluMul { .. }
                | Kernel::LastRow { .. }
                | Kernel::Argmax { .. } => {}
                other => return Err(cuda_err(format!("the CUDA backend has no kernel for {other:?}"))),
            }
        }
        let arena = DeviceBuffer::new(&device.ctx, plan.arena_words * 4)?;
        let step = DeviceBuffer::new(&device.ctx, (2 + plan.rows()) * 4)?;
        let argmax_rows = plan.rows();
        let head = DeviceBuffer::new(&device.ctx, (head_values + 2 * ARGMAX_BLOCKS * argmax_rows) * 4)?;
        Ok(CudaExecutable { plan, weights, device, arena, step, head, head_values, vocab, graph: None, use_graphs })
    }

    fn slot(&self, s: Slot) -> u64 {
        self.arena.ptr() + 4 * s.offset as u64
    }

    /// Enqueues every step of the plan for `n` active rows.
    fn enqueue(&self, n: usize, kv: &CudaKvCache, scratch: &mut Scratch) -> Result<(), RuntimeError> {
        let d = &*self.device;
        let (tokens, positions) = (self.input("tokens"), self.input("positions"));
        d.launch("set_inputs", (n.div_ceil(256) as u32, 1), 256, &[Arg::U64(self.step.ptr()), Arg::U64(tokens), Arg::U64(positions)])?;
        for step in &self.plan.steps {
            self.enqueue_step(&step.kernel, rows_of(step.rows, n), n, kv, scratch)?;
        }
        Ok(())
    }

    fn input(&self, name: &str) -> u64 {
        self.plan.inputs.iter().find(|i| i.name == name).map_or(0, |i| self.slot(i.slot))
    }

    /// `out[r] = x[r] · Wᵀ` for `rows` rows: matrix-vector kernels for few rows, else the weight
    /// dequantized to f32 and one cuBLAS GEMM.
    fn matmul(&self, x: u64, w: kiln_runtime::WeightId, out: u64, rows: usize, scratch: &mut Scratch) -> Result<(), RuntimeError> {
        let d = &*self.device;
        let m = self.weights.matrix(w)?;
        let fmt = format_name(m.ty).ok_or_else(|| cuda_err(format!("no kernels for {:?}", m.ty)))?;
        if rows <= MATVEC_ROWS {
            return d.launch(
                &format!("matvec_{fmt}"),
                (m.n.div_ceil(8) as u32, 1),
                256,
                &[
                    Arg::U64(m.buf.ptr()),
                    Arg::U64(m.row_bytes as u64),
                    Arg::U64(x),
                    Arg::U64(out),
                    Arg::I32(m.k as i32),
                    Arg::I32(m.n as i32),
                    Arg::I32(rows as i32),
                ],
            );
        }
        let tmp = scratch.dequant(&d.ctx, m.n * m.k * 4)?;
        let count = (m.n * m.k / 32) as u64;
        d.launch(
            &format!("dequant_{fmt}"),
            (count.div_ceil(256) as u32, 1),
            256,
            &[Arg::U64(m.buf.ptr()), Arg::U64(m.row_bytes as u64), Arg::U64(tmp), Arg::I32(m.k as i32), Arg::U64(m.n as u64)],
        )?;
        let (alpha, beta) = (1f32, 0f32);
        // Row-major out[rows, n] = x[rows, k] · W[n, k]ᵀ is column-major outᵀ = W · xᵀ.
        // SAFETY: the pointers are device buffers of the sizes the dimensions give.
        unsafe {
            cudarc::cublas::result::sgemm(
                *d.blas.handle(),
                cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T,
                cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_N,
                m.n as i32,
                rows as i32,
                m.k as i32,
                &alpha,
                tmp as *const f32,
                m.k as i32,
                x as *const f32,
                m.k as i32,
                &beta,
                out as *mut f32,
                m.n as i32,
            )
        }
        .map_err(|e| cuda_err(format!("cuBLAS sgemm: {e}")))
    }

    /// `out[r] = argmax(x[r])` over `width` values, in two phases.
    fn argmax(&self, x: u64, out: u64, rows: usize, width: usize) -> Result<(), RuntimeError> {
        let d = &*self.device;
        let pval = self.head.ptr() + 4 * self.head_values as u64;
        let pidx = pval + 4 * (ARGMAX_BLOCKS * self.plan.rows()) as u64;
        let blocks = ARGMAX_BLOCKS.min(width.div_ceil(256)).max(1);
        d.launch(
            "argmax_partial",
            (blocks as u32, rows as u32),
            256,
            &[Arg::U64(x), Arg::U64(pval), Arg::U64(pidx), Arg::I32(width as i32)],
        )?;
        d.launch("argmax_final", (rows as u32, 1), 32, &[Arg::U64(pval), Arg::U64(pidx), Arg::U64(out), Arg::I32(blocks as i32)])
    }

    fn elementwise(&self, a: u64, b: u64, out: u64, len: usize, op: i32) -> Result<(), RuntimeError> {
        let blocks = len.div_ceil(256) as u32;
        self.device.launch("elementwise", (blocks, 1), 256, &[Arg::U64(a), Arg::U64(b), Arg::U64(out), Arg::U64(len as u64), Arg::I32(op)])
    }

    fn enqueue_step(
        &self,
        kernel: &Kernel,
        rows: usize,
        active: usize,
        kv: &CudaKvCache,
        scratch: &mut Scratch,
    ) -> Result<(), RuntimeError> {
        let d = &*self.device;
        let w = &*self.weights;
        #[allow(unreachable_patterns)]
        match *kernel {
            Kernel::Embed { table, ids, out, width, scale } => {
                let m = w.matrix(table)?;
                let fmt = format_name(m.ty).ok_or_else(|| cuda_err(format!("no kernels for {:?}", m.ty)))?;
                d.launch(
                    &format!("embed_{fmt}"),
                    (rows as u32, 1),
                    128,
                    &[
                        Arg::U64(m.buf.ptr()),
                        Arg::U64(m.row_bytes as u64),
                        Arg::U64(self.slot(ids)),
                        Arg::U64(self.slot(out)),
                        Arg::I32(width as i32),
                        Arg::F32(scale),
                    ],
                )?;
            }
            Kernel::RmsNorm { x, weight, out, width, eps, residual } => {
                let wv = w.vector(weight)?;
                let group = wv.bytes() / 4;
                let groups = rows * width / group;
                let block = group.next_multiple_of(32).min(256) as u32;
                d.launch(
                    "rms_norm",
                    (groups as u32, 1),
                    block,
                    &[
                        Arg::U64(self.slot(x)),
                        Arg::U64(wv.ptr()),
                        Arg::U64(residual.map_or(0, |r| self.slot(r))),
                        Arg::U64(self.slot(out)),
                        Arg::I32(group as i32),
                        Arg::F32(eps),
                    ],
                )?;
            }
            Kernel::MatMul { x, w: wid, out, .. } => self.matmul(self.slot(x), wid, self.slot(out), rows, scratch)?,
            Kernel::MatMulArgmax { x, w: wid, out, n, .. } => {
                self.matmul(self.slot(x), wid, self.head.ptr(), rows, scratch)?;
                self.argmax(self.head.ptr(), self.slot(out), rows, n)?;
            }
            Kernel::Rope { x, positions, out, heads, head_dim, theta } => {
                let block = (head_dim / 2).next_multiple_of(32).min(128) as u32;
                d.launch(
                    "rope",
                    ((rows * heads) as u32, 1),
                    block,
                    &[
                        Arg::U64(self.slot(x)),
                        Arg::U64(self.slot(positions)),
                        Arg::U64(self.slot(out)),
                        Arg::I32(heads as i32),
                        Arg::I32(head_dim as i32),
                        Arg::F32(theta),
                    ],
                )?;
            }
            Kernel::Attention { q, k, v, out, layer, q_heads, kv_heads, head_dim, window, scale } => {
                let l = kv.layers.get(layer).ok_or_else(|| RuntimeError::StepShape(format!("the KV cache has no layer {layer}")))?;
                if l.spec.k_width() != kv_heads * head_dim || l.spec.v_width() != kv_heads * head_dim || l.spec.window != window {
                    return Err(RuntimeError::StepShape(format!("KV cache layer {layer} does not match the plan")));
                }
                let ring = window.map_or(0, |w| w.min(kv.context)) as i32;
                d.launch(
                    "attention",
                    ((active * q_heads) as u32, 1),
                    256,
                    &[
                        Arg::U64(self.slot(q)),
                        Arg::U64(self.slot(k)),
                        Arg::U64(self.slot(v)),
                        Arg::U64(l.k.ptr()),
                        Arg::U64(l.v.ptr()),
                        Arg::U64(self.slot(out)),
                        Arg::U64(self.step.ptr()),
                        Arg::I32(q_heads as i32),
                        Arg::I32(kv_heads as i32),
                        Arg::I32(head_dim as i32),
                        Arg::I32(ring),
                        Arg::F32(scale),
                    ],
                )?;
                d.launch(
                    "kv_append",
                    (active as u32, 1),
                    256,
                    &[
                        Arg::U64(self.slot(k)),
                        Arg::U64(self.slot(v)),
                        Arg::U64(l.k.ptr()),
                        Arg::U64(l.v.ptr()),
                        Arg::U64(self.step.ptr()),
                        Arg::I32((kv_heads * head_dim) as i32),
                        Arg::I32(ring),
                    ],
                )?;
            }
            Kernel::Add { a, b, out, width } => self.elementwise(self.slot(a), self.slot(b), self.slot(out), rows * width, 0)?,
            Kernel::Mul { a, b, out, width } => self.elementwise(self.slot(a), self.slot(b), self.slot(out), rows * width, 1)?,
            Kernel::Gelu { x, out, width } => self.elementwise(self.slot(x), 0, self.slot(out), rows * width, 2)?,
            Kernel::GeluMul { gate, up, out, width } => {
                self.elementwise(self.slot(gate), self.slot(up), self.slot(out), rows * width, 3)?
            }
            Kernel::LastRow { x, out, width } => d.launch(
                "copy_row",
                (width.div_ceil(256) as u32, 1),
                256,
                &[Arg::U64(self.slot(x)), Arg::U64(self.slot(out)), Arg::I32(active as i32 - 1), Arg::I32(width as i32)],
            )?,
            Kernel::Argmax { x, out, width } => self.argmax(self.slot(x), self.slot(out), rows, width)?,
            ref other => return Err(cuda_err(format!("the CUDA backend has no kernel for {other:?}"))),
        }
        Ok(())
    }

    /// Replays the captured decode step for `kv`, capturing it first if needed.
    fn replay(&mut self, kv: &CudaKvCache, scratch: &mut Scratch) -> Result<(), RuntimeError> {
        if self.graph.as_ref().is_none_or(|g| g.kv_id != kv.id) {
            self.graph = None;
            let stream = self.device.stream.clone();
            stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).map_err(cuda_err)?;
            let enqueued = self.enqueue(1, kv, scratch);
            let graph =
                stream.end_capture(sys::CUgraphInstantiate_flags(0)).map_err(|e| cuda_err(format!("capturing a decode graph: {e}")));
            enqueued?;
            let graph = graph?.ok_or_else(|| cuda_err("capturing a decode graph gave no graph"))?;
            self.graph = Some(CapturedStep { kv_id: kv.id, graph });
        }
        let g = self.graph.as_ref().map(|g| &g.graph).ok_or_else(|| cuda_err("no decode graph"))?;
        g.launch().map_err(|e| cuda_err(format!("launching the decode graph: {e}")))
    }
}

impl Executable for CudaExecutable {
    fn plan(&self) -> &Plan {
        &self.plan
    }

    fn run(&mut self, inputs: StepInputs<'_>, kv: &mut dyn KvCache) -> Result<Vec<HostTensor>, RuntimeError> {
        let n = inputs.tokens.len();
        if n == 0 || n > self.plan.rows() {
            return Err(RuntimeError::StepShape(format!("{n} tokens for a plan of {} rows", self.plan.rows())));
        }
        let kv = kv
            .as_any_mut()
            .downcast_mut::<CudaKvCache>()
            .ok_or_else(|| RuntimeError::StepShape("the KV cache does not belong to the CUDA backend".into()))?;
        if !Arc::ptr_eq(&kv.device, &self.device) {
            return Err(RuntimeError::StepShape("the KV cache lives on another CUDA device".into()));
        }
        if kv.len != inputs.start_pos {
            return Err(RuntimeError::StepShape(format!("step starts at {} but the KV cache holds {}", inputs.start_pos, kv.len)));
        }
        if inputs.start_pos + n > kv.context {
            return Err(RuntimeError::KvFull { capacity: kv.context, needed: inputs.start_pos + n });
        }
        if let Some(&bad) = inputs.tokens.iter().find(|&&t| t as usize >= self.vocab) {
            return Err(RuntimeError::TokenOutOfRange { id: bad, vocab: self.vocab });
        }
        let device = self.device.clone();
        let mut scratch = device.lock.lock().map_err(|_| cuda_err("a previous CUDA step panicked"))?;
        device.ctx.bind_to_thread().map_err(cuda_err)?;
        let mut step = Vec::with_capacity(2 + n);
        step.push(inputs.start_pos as i32);
        step.push(n as i32);
        step.extend(inputs.tokens.iter().map(|&t| t as i32));
        // SAFETY: the step buffer holds 2 + rows words; pageable memory is staged before return.
        unsafe { cudarc::driver::result::memcpy_htod_async(self.step.ptr(), &step, device.stream.cu_stream()) }.map_err(cuda_err)?;
        if self.use_graphs && self.plan.rows() == 1 {
            self.replay(kv, &mut scratch)?;
        } else {
            self.enqueue(n, kv, &mut scratch)?;
        }
        let mut outs = Vec::with_capacity(self.plan.outputs.len());
        for o in &self.plan.outputs {
            let rows = if o.rows == Rows::One { 1 } else { n };
            let len = rows * o.width;
            let src = self.slot(o.slot);
            let data = match o.dtype {
                DType::F32 => {
                    let mut v = vec![0f32; len];
                    // SAFETY: the output slot holds at least `len` words.
                    unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut v, src, device.stream.cu_stream()) }.map_err(cuda_err)?;
                    HostData::F32(v)
                }
                DType::I32 => {
                    let mut v = vec![0i32; len];
                    // SAFETY: as above.
                    unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut v, src, device.stream.cu_stream()) }.map_err(cuda_err)?;
                    HostData::I32(v)
                }
            };
            outs.push(HostTensor { name: o.name.clone(), shape: [rows, o.width], data });
        }
        device.sync()?;
        kv.len += n;
        Ok(outs)
    }
}

impl Drop for CudaExecutable {
    fn drop(&mut self) {
        let _ = self.device.sync_exclusive();
    }
}
