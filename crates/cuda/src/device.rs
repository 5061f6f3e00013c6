//! The device: context, stream, NVRTC-compiled kernel families (cached on disk), cuBLAS, raw
//! device buffers and the shared scratch of the GEMM path.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{result, sys, CudaContext, CudaFunction, CudaStream};
use cudarc::nvrtc::Ptx;
use kiln_quant::GgmlType;
use kiln_runtime::RuntimeError;
use sha2::{Digest, Sha256};

use crate::exec::Glu;
use crate::weights::format_name;

/// Shared by every family: types, f16 loads, reductions.
const COMMON: &str = include_str!("../kernels/common.cuh");
/// The kernel families: (name, CUDA C source).
const FAMILIES: [(&str, &str); 3] = [
    ("quant", include_str!("../kernels/quant.cu")),
    ("ops", include_str!("../kernels/ops.cu")),
    ("attention", include_str!("../kernels/attention.cu")),
];

/// A CUDA failure as a runtime error.
pub(crate) fn cuda_err(what: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Backend { backend: "cuda".into(), msg: what.to_string() }
}

/// `bytes` in GiB for messages ("1.50 GiB").
pub(crate) fn gib(bytes: usize) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// `e` (a backend error) with `what` said first: "what: e".
pub(crate) fn while_doing(e: RuntimeError, what: impl std::fmt::Display) -> RuntimeError {
    match e {
        RuntimeError::Backend { backend, msg } => RuntimeError::Backend { backend, msg: format!("{what}: {msg}") },
        other => other,
    }
}

/// A plain device allocation, freed on drop.
pub(crate) struct DeviceBuffer {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    bytes: usize,
}

impl DeviceBuffer {
    /// `bytes` of uninitialised device memory (at least one byte is allocated).
    pub(crate) fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self, RuntimeError> {
        ctx.bind_to_thread().map_err(cuda_err)?;
        // SAFETY: a plain allocation on the bound context.
        let ptr = unsafe { result::malloc_sync(bytes.max(1)) }.map_err(|e| {
            let free = match result::mem_get_info() {
                Ok((free, total)) => format!(", {} of the device's {} free", gib(free), gib(total)),
                Err(_) => String::new(),
            };
            cuda_err(format!("allocating {} ({bytes} bytes{free}): {e}", gib(bytes)))
        })?;
        Ok(DeviceBuffer { ctx: ctx.clone(), ptr, bytes })
    }

    /// The device address.
    pub(crate) fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Size in bytes.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by `new`, freed once; the stream is synchronised by whoever drops
            // a buffer still in use (executables and caches synchronise before release).
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

/// Scratch of the many-row matrix paths (not used inside captured graphs, so it may grow).
pub(crate) struct Scratch {
    /// Dequantized weights (f32) for cuBLAS.
    pub(crate) dequant: Option<DeviceBuffer>,
    /// Quantized activation rows for the tensor-core (`mmq`) kernels.
    pub(crate) quantized: Option<DeviceBuffer>,
    /// The activations `quantized` holds (address, width, rows) while no step since can have
    /// rewritten them: matrix products that share an input (q/k/v, gate/up) quantize it once.
    pub(crate) quantized_of: Option<(u64, usize, usize)>,
    /// Sized once for captured steps: a request for more is an error, not a new buffer (a graph
    /// keeps the addresses it was captured with).
    pub(crate) fixed: bool,
}

/// The address of `buf`, first replaced by a buffer of `bytes` if it is smaller (an error where
/// the scratch is `fixed`).
fn grown(buf: &mut Option<DeviceBuffer>, ctx: &Arc<CudaContext>, bytes: usize, fixed: bool) -> Result<u64, RuntimeError> {
    if buf.as_ref().is_none_or(|b| b.bytes() < bytes) {
        if fixed {
            return Err(cuda_err(format!("a captured step asked for {bytes} bytes of scratch beyond what its plan sized")));
        }
        *buf = None;
        *buf = Some(DeviceBuffer::new(ctx, bytes)?);
    }
    Ok(buf.as_ref().map_or(0, |b| b.ptr()))
}

impl Scratch {
    /// An empty scratch that grows as the steps need.
    pub(crate) fn growing() -> Scratch {
        Scratch { dequant: None, quantized: None, quantized_of: None, fixed: false }
    }

    /// A scratch of `quantized` bytes of quantized activations and no dequantized weights that
    /// never grows.
    pub(crate) fn fixed(ctx: &Arc<CudaContext>, quantized: usize) -> Result<Scratch, RuntimeError> {
        Ok(Scratch { dequant: None, quantized: Some(DeviceBuffer::new(ctx, quantized)?), quantized_of: None, fixed: true })
    }

    /// A scratch buffer of at least `bytes` for dequantized weights.
    pub(crate) fn dequant(&mut self, ctx: &Arc<CudaContext>, bytes: usize) -> Result<u64, RuntimeError> {
        grown(&mut self.dequant, ctx, bytes, self.fixed)
    }

    /// A scratch buffer of at least `bytes` for quantized activations.
    pub(crate) fn quantized(&mut self, ctx: &Arc<CudaContext>, bytes: usize) -> Result<u64, RuntimeError> {
        grown(&mut self.quantized, ctx, bytes, self.fixed)
    }
}

/// One CUDA device as kiln uses it.
pub struct Device {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) blas: CudaBlas,
    functions: HashMap<String, CudaFunction>,
    /// Serialises runs on the one stream and guards the scratch.
    pub(crate) lock: Mutex<Scratch>,
    pub(crate) name: String,
    pub(crate) arch: (i32, i32),
    /// Kernels launched so far (a captured graph's kernel count is the difference across its capture).
    pub(crate) launches: AtomicUsize,
    /// Kernels in the most recently captured decode graph.
    pub(crate) graph_kernels: AtomicUsize,
    /// Decode graphs captured so far.
    pub(crate) graph_captures: AtomicUsize,
    /// Whether kernels are launched with programmatic dependent launch (sm_90 and later).
    dependent_launch: bool,
    /// Multiprocessors.
    pub(crate) sms: u32,
}

// SAFETY: the cuBLAS handle is used only while `lock` is held; the other fields are thread-safe.
unsafe impl Sync for Device {}
// SAFETY: as above.
unsafe impl Send for Device {}

impl Device {
    /// Opens device `ordinal`, compiles (or loads from the disk cache) every kernel family.
    pub fn open(ordinal: usize) -> Result<Self, RuntimeError> {
        if let Some(missing) = missing_library() {
            return Err(cuda_err(format!(
                "the CUDA {missing} library was not found (install the NVIDIA driver and CUDA 12.8+ runtime libraries, or run with --device cpu)"
            )));
        }
        let count = CudaContext::device_count().map_err(|e| cuda_err(format!("no usable CUDA driver: {e}")))?;
        if ordinal >= count.max(0) as usize {
            return Err(cuda_err(format!("device cuda:{ordinal} does not exist ({count} CUDA devices)")));
        }
        let ctx = CudaContext::new(ordinal).map_err(cuda_err)?;
        // One stream, ordered by construction: no per-buffer event bookkeeping (it cannot be
        // captured into graphs anyway).
        // SAFETY: no buffer of this context exists yet.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(cuda_err)?;
        let blas = CudaBlas::new(stream.clone()).map_err(|e| cuda_err(format!("cuBLAS: {e}")))?;
        let arch = ctx.compute_capability().map_err(cuda_err)?;
        let name = ctx.name().map_err(cuda_err)?;
        let sms = ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).map_err(cuda_err)? as u32;
        let mut functions = HashMap::new();
        let programs = programs();
        let cubins = cubins(&programs, arch)?;
        for (program, cubin) in programs.into_iter().zip(cubins) {
            let module = ctx
                .load_module(Ptx::from_binary(cubin))
                .map_err(|e| cuda_err(format!("loading kernel program '{}': {e}", program.name)))?;
            for f in program.kernels {
                let func = module.load_function(&f).map_err(|e| cuda_err(format!("kernel '{f}': {e}")))?;
                // Kernels whose blocks take more than the default 48 KiB of shared memory opt in.
                // (The ring of matvec4 and matvec4p, and the latter's norm prologue row; the
                // ring of matvecr{rows}; the stages of mmq{tile} and mmqf{tile}; a chunk of attention_tiled.)
                let ring_rows = f.strip_prefix("matvecr").and_then(|r| r.split('_').next()?.parse().ok());
                let bytes = if let Some(rows) = ring_rows {
                    Some(crate::exec::ring_shared(rows) as u32)
                } else if let Some((block, tile, ty)) = mmq_kernel(&f) {
                    Some(block.shared(ty, tile) as u32)
                } else if f.starts_with("attention_tiled") {
                    Some(crate::exec::attention_tile_shared(crate::exec::ATTENTION_MAX_DIM) as u32)
                } else {
                    // (`matvec4_silu_q5_0`: the SiLU instance's format follows its infix.)
                    f.strip_prefix("matvec4_")
                        .or_else(|| f.strip_prefix("matvec4p_"))
                        .map(|r| r.strip_prefix("silu_").unwrap_or(r))
                        .map(crate::exec::matvec4_shared_bytes)
                        .filter(|&b| b > 0)
                        .map(|b| b + crate::exec::PROLOGUE_SHARED)
                };
                if let Some(bytes) = bytes {
                    func.set_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32)
                        .map_err(|e| cuda_err(format!("kernel '{f}': {bytes} bytes of shared memory: {e}")))?;
                }
                if !KEEP_CARVEOUT.iter().any(|p| f.starts_with(p)) {
                    func.set_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100)
                        .map_err(|e| cuda_err(format!("kernel '{f}': shared-memory carveout: {e}")))?;
                }
                functions.insert(f, func);
            }
        }
        tracing::info!("cuda:{ordinal}: {name}, sm_{}{}, {} kernels", arch.0, arch.1, functions.len());
        Ok(Device {
            ctx,
            stream,
            blas,
            functions,
            lock: Mutex::new(Scratch::growing()),
            name,
            arch,
            launches: AtomicUsize::new(0),
            graph_kernels: AtomicUsize::new(0),
            graph_captures: AtomicUsize::new(0),
            sms,
            dependent_launch: arch.0 >= 9,
        })
    }

    /// A kernel by name.
    pub(crate) fn function(&self, name: &str) -> Result<&CudaFunction, RuntimeError> {
        self.functions.get(name).ok_or_else(|| cuda_err(format!("no kernel named '{name}'")))
    }

    /// Launches kernel `name` with `grid` blocks of `block` threads and `args`. On devices with
    /// programmatic dependent launch (sm_90+) the kernel may start while the previous one runs:
    /// every kernel waits for its predecessor before touching what it wrote (common.cuh).
    pub(crate) fn launch(&self, name: &str, grid: (u32, u32), block: u32, args: &[Arg]) -> Result<(), RuntimeError> {
        self.launch_shared(name, (grid.0, grid.1, 1), block, 0, args)
    }

    /// `launch` with a grid of three dimensions and `shared` bytes of dynamic shared memory per block.
    pub(crate) fn launch_shared(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        shared: u32,
        args: &[Arg],
    ) -> Result<(), RuntimeError> {
        let f = self.function(name)?;
        // Each argument in its own 8-byte word (4-byte arguments in the low bytes: little-endian).
        let mut words: Vec<u64> = args
            .iter()
            .map(|a| match *a {
                Arg::U64(v) => v,
                Arg::I32(v) => v as u32 as u64,
                Arg::F32(v) => v.to_bits() as u64,
            })
            .collect();
        let mut params: Vec<*mut std::ffi::c_void> = words.iter_mut().map(|w| w as *mut u64 as *mut std::ffi::c_void).collect();
        // SAFETY: an all-zero attribute value is valid (a plain C union).
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let cfg = sys::CUlaunchConfig {
            gridDimX: grid.0.max(1),
            gridDimY: grid.1.max(1),
            gridDimZ: grid.2.max(1),
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: shared,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: self.dependent_launch as u32,
        };
        // SAFETY: the argument lists match the kernels' signatures (see kernels/*.cu; every
        // argument is passed by address and copied by the call); every pointer is a live device
        // allocation sized by the plan.
        unsafe { sys::cuLaunchKernelEx(&cfg, f.cu_function(), params.as_mut_ptr(), std::ptr::null_mut()) }
            .result()
            .map_err(|e| cuda_err(format!("launching '{name}': {e}")))?;
        self.launches.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Blocks until the stream is idle (the caller holds `lock`).
    pub(crate) fn sync(&self) -> Result<(), RuntimeError> {
        self.stream.synchronize().map_err(cuda_err)
    }

    /// Blocks until the stream is idle, first waiting for any run in progress on another thread
    /// (a stream may not be synchronised while a graph is being captured on it).
    pub(crate) fn sync_exclusive(&self) -> Result<(), RuntimeError> {
        let _guard = self.lock.lock().map_err(|_| cuda_err("a previous CUDA step panicked"))?;
        self.sync()
    }
}

/// A kernel argument.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Arg {
    /// A pointer or 64-bit count.
    U64(u64),
    /// A 32-bit integer.
    I32(i32),
    /// A float.
    F32(f32),
}

/// Every `extern "C" __global__ void NAME(` of a source, with `KILN_FORMAT(name, ...)`,
/// `KILN_RING(name, ...)` (their matrix-vector kernels once per glu activation, `Glu::infix`) and
/// `KILN_MMQ(name, ...)` expanded.
fn kernel_names(src: &str) -> Vec<String> {
    let mut names = Vec::new();
    for line in src.lines() {
        if let Some(rest) = line.strip_prefix("extern \"C\" __global__ void ") {
            // `__launch_bounds__(...)` may precede the name.
            let rest = rest.strip_prefix("__launch_bounds__(").and_then(|r| r.split_once(')')).map_or(rest, |(_, r)| r.trim_start());
            if let Some(name) = rest.split('(').next() {
                names.push(name.trim().to_string());
            }
        } else if let Some(rest) = line.strip_prefix("KILN_FORMAT(") {
            let fmt = rest.split(',').next().unwrap_or_default().trim();
            for act in Glu::ALL {
                names.extend(["matvec", "matvec1", "matvec4", "matvec4p"].map(|k| format!("{k}{}_{fmt}", act.infix())));
            }
            names.extend(["embed", "dequant"].map(|k| format!("{k}_{fmt}")));
        } else if let Some(rest) = line.strip_prefix("KILN_RING(") {
            let fmt = rest.split(',').next().unwrap_or_default().trim();
            for act in Glu::ALL {
                names.extend(["matvecr8", "matvecr4", "matvecr2"].map(|k| format!("{k}{}_{fmt}", act.infix())));
            }
        } else if let Some(rest) = line.strip_prefix("KILN_MMQ(") {
            let fmt = rest.split(',').next().unwrap_or_default().trim();
            for block in crate::exec::MMQ_BLOCKS {
                names.extend(block.tiles.map(|t| format!("{}{t}_{fmt}", block.prefix)));
            }
        }
    }
    names
}

/// Kernels (name prefixes) that keep the driver's choice of the split between L1 cache and shared
/// memory: the one-row decode kernels (matrix-vector products, fused q/k attention, the greedy
/// head). Every other kernel asks for the most shared memory, so that a many-row step, whose `mmq`
/// blocks take 63-88 KB each, never waits for a multiprocessor to drain and change its split
/// between two launches (measured on an H200, default model: prompts of 64 tokens 24,400 ->
/// 30,900 tokens/s, of 512 66,400 -> 71,500; every kernel asking for it made 12B decode 3% slower:
/// bench/RESULTS.md "issue 4s").
const KEEP_CARVEOUT: [&str; 3] = ["matvec", "attention_qk", "argmax_head"];

/// The block shape, tile and format of an `mmq{tile}_<fmt>` or `mmqf{tile}_<fmt>` kernel name.
/// (A prefix that is another's start leaves a tile that does not parse: "mmq" of "mmqf16_q8_0".)
fn mmq_kernel(name: &str) -> Option<(crate::exec::MmqBlock, usize, GgmlType)> {
    crate::exec::MMQ_BLOCKS.into_iter().find_map(|block| {
        let (tile, fmt) = name.strip_prefix(block.prefix)?.split_once('_')?;
        let ty = crate::exec::MMQ_FORMATS.into_iter().find(|&ty| format_name(ty) == Some(fmt))?;
        Some((block, tile.parse().ok()?, ty))
    })
}

/// The first CUDA library this backend loads at run time that cannot be found ("driver", "NVRTC"
/// or "cuBLAS"), if any: cudarc panics on a missing library, so it is checked before any call.
pub(crate) fn missing_library() -> Option<&'static str> {
    // SAFETY: these only try to open the shared libraries by name.
    unsafe {
        [
            ("driver", cudarc::driver::sys::is_culib_present()),
            ("NVRTC", cudarc::nvrtc::sys::is_culib_present()),
            ("cuBLAS", cudarc::cublas::sys::is_culib_present()),
        ]
    }
    .into_iter()
    .find_map(|(name, present)| (!present).then_some(name))
}

/// NVRTC's version (major, minor).
fn nvrtc_version() -> Result<(i32, i32), RuntimeError> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: plain out-parameters.
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| cuda_err(format!("NVRTC is not usable: {e}")))?;
    Ok((major, minor))
}

/// One NVRTC program: a kernel family, or for the quantized family its shared code with one line
/// of template instances (`KILN_FORMAT`, `KILN_RING`, `KILN_MMQ`), so that a first use compiles
/// them on every core instead of one program on one (175 s on one core of the H100's host, 20 s on
/// its 16).
struct Program {
    /// `<family>`, or `<family>-<macro>-<format>` for an instance line (`quant-format-q4_k`), for
    /// messages and the cache file.
    name: String,
    /// The full source: `common.cuh`, then the program's code.
    source: String,
    /// The kernels this program's module provides.
    kernels: Vec<String>,
}

/// Whether `line` instantiates kernel templates (a macro `kernel_names` expands).
fn is_instance_line(line: &str) -> bool {
    ["KILN_FORMAT(", "KILN_RING(", "KILN_MMQ("].iter().any(|p| line.starts_with(p))
}

/// Every family cut into its programs: a family without instance lines is one program; one with
/// them is its code without them (its own `extern "C"` kernels) plus one program per instance
/// line (that code with the line: each such module also holds the family's own kernels, unused,
/// a fraction of a second of compilation each).
fn programs() -> Vec<Program> {
    let mut out = Vec::new();
    for (family, src) in FAMILIES {
        let code: String = src.lines().filter(|l| !is_instance_line(l)).map(|l| format!("{l}\n")).collect();
        out.push(Program { name: family.to_string(), source: format!("{COMMON}\n{code}"), kernels: kernel_names(&code) });
        for line in src.lines().filter(|l| is_instance_line(l)) {
            let (instances, args) = line.split_once('(').unwrap_or((line, ""));
            let what = format!("{}-{}", instances.trim_start_matches("KILN_").to_lowercase(), args.split(',').next().unwrap_or("").trim());
            out.push(Program {
                name: format!("{family}-{what}"),
                source: format!("{COMMON}\n{code}{line}\n"),
                kernels: kernel_names(line),
            });
        }
    }
    out
}

/// The native code (CUBIN) of every program for `arch`, in order: from the disk cache (keyed by a
/// hash of the source, the architecture and the NVRTC version) or compiled by NVRTC (the missing
/// ones at once on up to one thread per core) and stored there. NVRTC compiles for the device's
/// real architecture, so the driver loads machine code and never compiles PTX itself (that took
/// over a minute for the quantized kernels on a fresh machine).
fn cubins(programs: &[Program], arch: (i32, i32)) -> Result<Vec<Vec<u8>>, RuntimeError> {
    let nvrtc = nvrtc_version()?;
    let paths: Vec<Option<PathBuf>> = programs
        .iter()
        .map(|p| {
            let mut h = Sha256::new();
            h.update(p.source.as_bytes());
            h.update(format!("sm_{}{} nvrtc {}.{}", arch.0, arch.1, nvrtc.0, nvrtc.1).as_bytes());
            let key: String = h.finalize().iter().take(12).map(|b| format!("{b:02x}")).collect();
            cache_path(&p.name, &key)
        })
        .collect();
    let mut out: Vec<Option<Vec<u8>>> = paths.iter().map(|p| p.as_ref().and_then(|p| std::fs::read(p).ok())).collect();
    let missing: Vec<usize> = (0..programs.len()).filter(|&i| out[i].is_none()).collect();
    if !missing.is_empty() {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(missing.len());
        // Worth a line by default: on one core the quantized family takes about three minutes.
        tracing::warn!(
            "compiling {} CUDA kernel programs for sm_{}{} on {threads} threads (first use on this GPU architecture, can take a minute; cached for later runs)",
            missing.len(),
            arch.0,
            arch.1
        );
        let started = std::time::Instant::now();
        let next = AtomicUsize::new(0);
        let compiled: Vec<(usize, Result<Vec<u8>, RuntimeError>)> = std::thread::scope(|s| {
            let workers: Vec<_> = (0..threads)
                .map(|_| {
                    s.spawn(|| {
                        let mut done = Vec::new();
                        while let Some(&i) = missing.get(next.fetch_add(1, Ordering::Relaxed)) {
                            done.push((i, nvrtc_cubin(&programs[i].name, &programs[i].source, arch)));
                        }
                        done
                    })
                })
                .collect();
            workers.into_iter().flat_map(|w| w.join().unwrap_or_default()).collect()
        });
        for (i, cubin) in compiled {
            let cubin = cubin?;
            if let Some(p) = &paths[i] {
                let stored = p.parent().map(std::fs::create_dir_all).transpose().and_then(|_| {
                    let tmp = p.with_extension("tmp");
                    std::fs::write(&tmp, &cubin)?;
                    std::fs::rename(&tmp, p)
                });
                if let Err(e) = stored {
                    tracing::warn!("could not cache kernel program '{}' at {}: {e}", programs[i].name, p.display());
                }
            }
            out[i] = Some(cubin);
        }
        tracing::info!("compiled {} CUDA kernel programs in {:.1} s", missing.len(), started.elapsed().as_secs_f64());
    }
    out.into_iter()
        .zip(programs)
        .map(|(c, p)| c.ok_or_else(|| cuda_err(format!("kernel program '{}' was not compiled (a compiler thread panicked)", p.name))))
        .collect()
}

/// Compiles `src` (kernel program `program`) with NVRTC to a CUBIN for `arch`.
fn nvrtc_cubin(program: &str, src: &str, arch: (i32, i32)) -> Result<Vec<u8>, RuntimeError> {
    use cudarc::nvrtc::result;
    let fail = |what: String| cuda_err(format!("NVRTC failed on kernel program '{program}': {what}"));
    let code = std::ffi::CString::new(src).map_err(|_| fail("the source holds a NUL byte".into()))?;
    let name = std::ffi::CString::new(format!("{program}.cu")).map_err(|_| fail("bad family name".into()))?;
    let prog = result::create_program(&code, Some(&name)).map_err(|e| fail(format!("{e:?}")))?;
    let options = [format!("--gpu-architecture=sm_{}{}", arch.0, arch.1), "--std=c++17".to_string()];
    // SAFETY: `prog` is a live program until `destroy_program` below; the buffers are sized by
    // NVRTC's own size queries.
    unsafe {
        let cubin = match result::compile_program(prog, &options) {
            Err(e) => {
                let log = result::get_program_log(prog).map(|l| l.iter().map(|&c| c as u8 as char).collect::<String>()).unwrap_or_default();
                Err(fail(format!("{e:?}\n{}", log.trim_end_matches('\0'))))
            }
            Ok(()) => {
                let mut size = 0usize;
                cudarc::nvrtc::sys::nvrtcGetCUBINSize(prog, &mut size).result().map_err(|e| fail(format!("{e:?}"))).and_then(|()| {
                    let mut buf = vec![0u8; size];
                    cudarc::nvrtc::sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr().cast()).result().map_err(|e| fail(format!("{e:?}")))?;
                    Ok(buf)
                })
            }
        };
        let _ = result::destroy_program(prog);
        cubin
    }
}

/// Where a compiled program is cached (`<kiln cache>/cuda/<program>-<key>.cubin`).
fn cache_path(program: &str, key: &str) -> Option<PathBuf> {
    kiln_hub::cache_dir().ok().map(|d| d.join("cuda").join(format!("{program}-{key}.cubin")))
}

/// Median read bandwidth (bytes/s) over `reps` reads of a `bytes` buffer, timed with events.
pub(crate) fn read_bandwidth(d: &Device, bytes: usize, reps: usize) -> Result<f64, RuntimeError> {
    let _guard = d.lock.lock().map_err(|_| cuda_err("a previous CUDA step panicked"))?;
    let words = bytes / 16;
    let src = DeviceBuffer::new(&d.ctx, words * 16)?;
    let sink = DeviceBuffer::new(&d.ctx, 16)?;
    // SAFETY: `src` holds `words * 16` bytes.
    unsafe { result::memset_d8_async(src.ptr(), 1, words * 16, d.stream.cu_stream()) }.map_err(cuda_err)?;
    let sms = d.ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).map_err(cuda_err)?;
    let args = [Arg::U64(src.ptr()), Arg::U64(words as u64), Arg::U64(sink.ptr())];
    let grid = (sms as u32 * 4, 1);
    d.launch("read_bandwidth", grid, 512, &args)?;
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        let start = d.ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(cuda_err)?;
        let end = d.ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(cuda_err)?;
        start.record(&d.stream).map_err(cuda_err)?;
        d.launch("read_bandwidth", grid, 512, &args)?;
        end.record(&d.stream).map_err(cuda_err)?;
        end.synchronize().map_err(cuda_err)?;
        times.push(start.elapsed_ms(&end).map_err(cuda_err)? as f64 / 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok((words * 16) as f64 / times[times.len() / 2])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_comes_from_exactly_one_program() {
        let programs = programs();
        let mut from_programs: Vec<String> = programs.iter().flat_map(|p| p.kernels.clone()).collect();
        let mut from_families: Vec<String> = FAMILIES.iter().flat_map(|(_, src)| kernel_names(src)).collect();
        assert_eq!(from_programs.len(), from_families.len());
        from_programs.sort();
        from_families.sort();
        assert_eq!(from_programs, from_families);
        let n = from_programs.len();
        from_programs.dedup();
        assert_eq!(from_programs.len(), n, "a kernel name twice");
        // The quantized family: its own kernels, then one program per instance line, each with
        // every template but only its line's instances.
        let quant: Vec<&Program> = programs.iter().filter(|p| p.name.starts_with("quant")).collect();
        assert_eq!(quant.len(), 1 + 13 + 8 + 10);
        assert_eq!(quant[0].kernels, ["argmax_head_q8_0", "quantize_rows"]);
        let format = quant.iter().find(|p| p.name == "quant-format-q4_k").unwrap();
        assert!(format.kernels.contains(&"matvec4p_silu_q4_k".to_string()) && format.kernels.len() == 10);
        assert!(format.source.starts_with(COMMON) && format.source.contains("template"));
        assert_eq!(format.source.lines().filter(|l| is_instance_line(l)).collect::<Vec<_>>(), ["KILN_FORMAT(q4_k, F_Q4_K)"]);
        assert!(quant.iter().any(|p| p.name == "quant-ring-q6_k") && quant.iter().any(|p| p.name == "quant-mmq-q5_0"));
        assert!(programs.iter().any(|p| p.name == "ops") && programs.iter().any(|p| p.name == "attention"));
    }

    #[test]
    fn kernel_names_are_found_in_every_family() {
        let quant = kernel_names(FAMILIES[0].1);
        assert!(quant.contains(&"matvec_q4_k".to_string()) && quant.contains(&"dequant_q8_0".to_string()));
        // Per format 4 matrix-vector kernels per glu activation, embed and dequant; quantize_rows
        // and the greedy head; 3 ring kernels per activation of 8 formats; the mmq tiles.
        assert_eq!(quant.len(), 13 * (4 * 2 + 2) + 2 + 8 * 3 * 2 + 10 * 4 * 2);
        assert!(quant.contains(&"matvecr2_q6_k".to_string()) && quant.contains(&"mmq8_q5_0".to_string()));
        assert!(quant.contains(&"matvec4p_silu_q5_0".to_string()) && quant.contains(&"matvecr4_silu_q8_0".to_string()));
        assert!(quant.contains(&"mmq128_q4_k".to_string()));
        assert!(quant.contains(&"mmqf16_q4_k".to_string()));
        assert_eq!(mmq_kernel("mmq64_q6_k"), Some((crate::exec::MMQ_MANY, 64, GgmlType::Q6_K)));
        assert_eq!(mmq_kernel("mmqf16_q8_0"), Some((crate::exec::MMQ_FEW, 16, GgmlType::Q8_0)));
        assert_eq!(mmq_kernel("matvec_q6_k"), None);
        assert!(quant.contains(&"quantize_rows".to_string()));
        let ops = kernel_names(FAMILIES[1].1);
        for k in [
            "set_inputs",
            "rms_norm",
            "rms_norm2",
            "qk_norm_rope",
            "rope",
            "rope_scaled",
            "rms_normalize",
            "elementwise",
            "copy_last_rows",
            "argmax_partial",
            "argmax_final",
        ] {
            assert!(ops.contains(&k.to_string()), "{k}");
        }
        // The attention family is the KV cache kernels, each in its f32 and f16 instance.
        let mut attention = kernel_names(FAMILIES[2].1);
        let mut want: Vec<String> = crate::exec::KV_KERNELS.iter().flat_map(|&(a, b)| [a.to_string(), b.to_string()]).collect();
        attention.sort();
        want.sort();
        assert_eq!(attention, want);
    }
}
