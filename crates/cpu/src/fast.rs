//! The fast kernels: activations quantized to 8-bit blocks per row (ggml's Q8_0 for the 32-element
//! formats, Q8_K with per-16 sums for the K-quants), weights unpacked a tile of rows at a time into
//! integer levels and scales, and integer dot products (AVX2 `maddubs`/`madd`, or scalar).
//!
//! Each weight format has one unpack function (per instruction set) into one of two unpacked
//! families, and each family has one integer dot core that multiplies one weight row with up to
//! [`ROW_GROUP`] activation rows at once, so prefill reads and unpacks each weight row once per
//! group of rows. Formats without an unpack function (F32, F16, BF16, Q4_1, Q5_1, Q8_K) run the
//! exact kernels instead (see [`supports`]).

mod act;
#[cfg(target_arch = "x86_64")]
mod avx2;
mod scalar;
mod screen;

use std::cell::RefCell;

use kiln_quant::GgmlType;

use crate::kernels::SharedMut;
use crate::pool::ThreadPool;
use crate::simd::Isa;
use crate::weights::PackedMatrix;

pub use act::QuantizedRows;
pub use screen::make_copy as make_screening_copy;

/// Activation rows multiplied with each unpacked weight row at once.
pub const ROW_GROUP: usize = 4;

/// Quantization passes of the activations of every product: the 8-bit row plus its 8-bit
/// residual. With one pass (as ggml) Gemma 3's logits end 3e-2..7e-2 (relative L2) from the
/// float32 reference; two passes for the K-quant products only leave 1e-2..4e-2, for the 32-block
/// ones only 2e-2..1.2e-1; two passes everywhere bring them to about 1e-4, at twice the integer
/// work (decode, memory-bound, barely notices).
pub const PASSES: usize = 2;

/// Which unpacked representation a weight format uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// 32-element blocks: signed levels and one f32 scale per block (Q4_0, Q5_0, Q8_0); Q8_0
    /// activations.
    Legacy,
    /// 256-element super-blocks: unsigned levels, integer scales and corrections per 16 elements,
    /// two f32 scales per super-block (Q2_K..Q6_K); Q8_K activations.
    KQuant,
}

impl Family {
    /// Elements per activation block.
    pub fn act_block(self) -> usize {
        match self {
            Family::Legacy => 32,
            Family::KQuant => 256,
        }
    }
}

/// The fast family of weight format `ty`, or `None` when only the exact kernels handle it.
pub fn family(ty: GgmlType) -> Option<Family> {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => Some(Family::Legacy),
        GgmlType::Q2_K | GgmlType::Q3_K | GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => Some(Family::KQuant),
        _ => None,
    }
}

/// Whether the fast kernels handle weight format `ty`.
pub fn supports(ty: GgmlType) -> bool {
    family(ty).is_some()
}

/// One activation row quantized to 8-bit blocks.
#[derive(Clone, Copy)]
pub struct ActRow<'a> {
    /// Levels, `k` of them.
    pub qs: &'a [i8],
    /// One scale per block.
    pub d: &'a [f32],
    /// Sums of the levels of every 16 elements (Q8_K rows; empty for Q8_0 rows).
    pub sums: &'a [i16],
}

/// Weight rows unpacked for the integer cores: one buffer per field, `rows` rows of `k` elements.
#[derive(Default)]
pub struct Unpacked {
    /// Legacy: signed levels; K-quants: unsigned levels (as `u8` bit patterns), `k` per row.
    q: Vec<i8>,
    /// Legacy: one scale per 32; K-quants: `d` per super-block.
    d: Vec<f32>,
    /// K-quants: the multiplier of the corrections per super-block (`dmin`, or `d` for offset formats).
    dcorr: Vec<f32>,
    /// K-quants: integer scale per 16 elements.
    sc: Vec<i16>,
    /// K-quants: integer correction per 16 elements, multiplied by the activations' 16-sums.
    corr: Vec<i16>,
}

/// One unpacked 32-block weight row.
#[derive(Clone, Copy)]
pub struct LegacyRow<'a> {
    /// Signed levels.
    pub qs: &'a [i8],
    /// One scale per 32 elements.
    pub d: &'a [f32],
}

/// One unpacked K-quant weight row: `Σ_b a.d[b] (d[b] Σ_g sc[g] Σ_{i∈g} q[i] a[i] - dcorr[b] Σ_g corr[g] sums[g])`.
#[derive(Clone, Copy)]
pub struct KRow<'a> {
    /// Unsigned levels (0..=63).
    pub q: &'a [u8],
    /// Scale per 16 elements.
    pub sc: &'a [i16],
    /// Correction per 16 elements.
    pub corr: &'a [i16],
    /// Super-block scale.
    pub d: &'a [f32],
    /// Super-block correction scale.
    pub dcorr: &'a [f32],
}

impl Unpacked {
    /// Unpacks rows `r0..r0 + cnt` of `w` (a fast format) with instruction set `isa`.
    fn fill(&mut self, isa: Isa, w: &PackedMatrix<'_>, r0: usize, cnt: usize) {
        let k = w.k;
        let fam = family(w.ty).expect("a fast format");
        let (nd, ng) = match fam {
            Family::Legacy => (k / 32, 0),
            Family::KQuant => (k / 256, k / 16),
        };
        grow(&mut self.q, cnt * k);
        grow(&mut self.d, cnt * nd);
        if fam == Family::KQuant {
            grow(&mut self.dcorr, cnt * nd);
            grow(&mut self.sc, cnt * ng);
            grow(&mut self.corr, cnt * ng);
        }
        for j in 0..cnt {
            let src = w.row(r0 + j);
            let q = &mut self.q[j * k..(j + 1) * k];
            let d = &mut self.d[j * nd..(j + 1) * nd];
            match fam {
                Family::Legacy => unpack_legacy(isa, w.ty, src, q, d),
                Family::KQuant => {
                    let q = as_u8_mut(q);
                    let dc = &mut self.dcorr[j * nd..(j + 1) * nd];
                    let sc = &mut self.sc[j * ng..(j + 1) * ng];
                    let corr = &mut self.corr[j * ng..(j + 1) * ng];
                    unpack_k(isa, w.ty, src, KRowMut { q, sc, corr, d, dcorr: dc });
                }
            }
        }
    }

    /// Unpacked 32-block row `j` of `k` elements.
    pub fn legacy(&self, j: usize, k: usize) -> LegacyRow<'_> {
        LegacyRow { qs: &self.q[j * k..(j + 1) * k], d: &self.d[j * k / 32..(j + 1) * k / 32] }
    }

    /// Unpacked K-quant row `j` of `k` elements.
    pub fn kquant(&self, j: usize, k: usize) -> KRow<'_> {
        let (nd, ng) = (k / 256, k / 16);
        KRow {
            q: as_u8(&self.q[j * k..(j + 1) * k]),
            sc: &self.sc[j * ng..(j + 1) * ng],
            corr: &self.corr[j * ng..(j + 1) * ng],
            d: &self.d[j * nd..(j + 1) * nd],
            dcorr: &self.dcorr[j * nd..(j + 1) * nd],
        }
    }
}

/// Mutable views of one K-quant row being unpacked.
pub struct KRowMut<'a> {
    /// Unsigned levels.
    pub q: &'a mut [u8],
    /// Scale per 16 elements.
    pub sc: &'a mut [i16],
    /// Correction per 16 elements.
    pub corr: &'a mut [i16],
    /// Super-block scale.
    pub d: &'a mut [f32],
    /// Super-block correction scale.
    pub dcorr: &'a mut [f32],
}

fn grow<T: Default + Clone>(v: &mut Vec<T>, len: usize) {
    if v.len() < len {
        v.resize(len, T::default());
    }
}

fn as_u8(q: &[i8]) -> &[u8] {
    // SAFETY: i8 and u8 have the same size and alignment.
    unsafe { std::slice::from_raw_parts(q.as_ptr() as *const u8, q.len()) }
}

fn as_u8_mut(q: &mut [i8]) -> &mut [u8] {
    // SAFETY: as in `as_u8`.
    unsafe { std::slice::from_raw_parts_mut(q.as_mut_ptr() as *mut u8, q.len()) }
}

/// Unpacks one row of a 32-block format.
fn unpack_legacy(isa: Isa, ty: GgmlType, src: &[u8], q: &mut [i8], d: &mut [f32]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: Avx2Fma is only chosen on CPUs that have it; lengths follow from the row layout.
        Isa::Avx2Fma => unsafe { avx2::unpack_legacy(ty, src, q, d) },
        _ => scalar::unpack_legacy(ty, src, q, d),
    }
}

/// Unpacks one row of a K-quant format.
fn unpack_k(isa: Isa, ty: GgmlType, src: &[u8], out: KRowMut<'_>) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `unpack_legacy`.
        Isa::Avx2Fma => unsafe { avx2::unpack_k(ty, src, out) },
        _ => scalar::unpack_k(ty, src, out),
    }
}

/// Products of unpacked weight rows `0..out.len()` of `tile` with activation rows `acts` (at most
/// [`ROW_GROUP`]): `out[j][i] = acts[i] · row j`.
fn dot_tile(isa: Isa, fam: Family, tile: &Unpacked, k: usize, acts: &[ActRow<'_>], out: &mut [[f32; ROW_GROUP]]) {
    macro_rules! call {
        ($r:literal) => {{
            let a: [ActRow<'_>; $r] = std::array::from_fn(|i| acts[i]);
            match (fam, isa) {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: Avx2Fma is only chosen on CPUs that have it; row lengths agree.
                (Family::Legacy, Isa::Avx2Fma) => unsafe { avx2::legacy_tile(tile, k, a, out) },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: as above.
                (Family::KQuant, Isa::Avx2Fma) => unsafe { avx2::k_tile(tile, k, a, out) },
                (Family::Legacy, _) => {
                    for (j, o) in out.iter_mut().enumerate() {
                        o[..$r].copy_from_slice(&scalar::legacy_dot(tile.legacy(j, k), a));
                    }
                }
                (Family::KQuant, _) => {
                    for (j, o) in out.iter_mut().enumerate() {
                        o[..$r].copy_from_slice(&scalar::k_dot(tile.kquant(j, k), a));
                    }
                }
            }
        }};
    }
    match acts.len() {
        1 => call!(1),
        2 => call!(2),
        3 => call!(3),
        _ => call!(4),
    }
}

thread_local! {
    static TILE: RefCell<Unpacked> = RefCell::new(Unpacked::default());
}

/// Weight rows unpacked per tile: about 16 KiB of levels, 4..=32 rows.
fn tile_rows(k: usize) -> usize {
    (16384 / k.max(1)).clamp(4, 32)
}

/// Calls `emit(row, col, x[row] · w[col])` for every activation row and every weight row in `cols`.
fn products(isa: Isa, w: &PackedMatrix<'_>, acts: &QuantizedRows, cols: std::ops::Range<usize>, mut emit: impl FnMut(usize, usize, f32)) {
    let (k, fam) = (w.k, family(w.ty).expect("a fast format"));
    let tr = tile_rows(k);
    let mut results = [[0f32; ROW_GROUP]; 32];
    TILE.with(|t| {
        let mut tile = t.borrow_mut();
        let mut c0 = cols.start;
        while c0 < cols.end {
            let cnt = tr.min(cols.end - c0);
            tile.fill(isa, w, c0, cnt);
            let (stored, passes) = (acts.rows() * acts.passes(), acts.passes());
            let mut r0 = 0;
            while r0 < stored {
                let rc = ROW_GROUP.min(stored - r0);
                let group: [ActRow<'_>; ROW_GROUP] = std::array::from_fn(|i| acts.row(r0 + i.min(rc - 1)));
                let res = &mut results[..cnt];
                dot_tile(isa, fam, &tile, k, &group[..rc], res);
                for (j, row) in res.iter().enumerate() {
                    // A row's passes are adjacent and never split across groups (passes divides ROW_GROUP).
                    for (i, v) in row[..rc].chunks_exact(passes).enumerate() {
                        emit(r0 / passes + i, c0 + j, v.iter().sum());
                    }
                }
                r0 += rc;
            }
            c0 += cnt;
        }
    });
}

/// `out[r, j] = q8(x[r, :]) · w[j, :]` for `rows` rows; `w` must be a fast format.
pub fn matmul(pool: &ThreadPool, isa: Isa, x: &[f32], rows: usize, w: &PackedMatrix<'_>, out: &mut [f32]) {
    let (k, n) = (w.k, w.n);
    let fam = family(w.ty).expect("a fast format");
    let acts = QuantizedRows::new(pool, isa, &x[..rows * k], rows, k, fam.act_block(), PASSES);
    let out = SharedMut(out[..rows * n].as_mut_ptr());
    pool.for_chunks(n, 16, &|range| {
        products(isa, w, &acts, range, |r, j, v| {
            // SAFETY: column j belongs to this task's range only.
            unsafe { *out.ptr().add(r * n + j) = v };
        });
    });
}

/// Whether a greedy head over `w` should get a screening copy (a vocabulary-sized fast matrix).
pub fn wants_screening_copy(w: &PackedMatrix<'_>) -> bool {
    supports(w.ty) && w.n >= screen::MIN_ROWS && w.k.is_multiple_of(32)
}

/// `out[r] = argmax_j q8(x[r, :]) · w[j, :]` (lowest index among equal maxima), without storing
/// the products; `-1` when any product is not finite. `w` must be a fast format. With `screen`
/// (w's Q4_0 copy, from [`make_screening_copy`]) and at most a few rows, only the copy's best
/// candidates are scored with `w` (see `screen`).
pub fn matmul_argmax(
    pool: &ThreadPool,
    isa: Isa,
    x: &[f32],
    rows: usize,
    w: &PackedMatrix<'_>,
    screen: Option<&PackedMatrix<'_>>,
    out: &mut [i32],
) {
    let (k, n) = (w.k, w.n);
    let fam = family(w.ty).expect("a fast format");
    let acts = QuantizedRows::new(pool, isa, &x[..rows * k], rows, k, fam.act_block(), PASSES);
    if let Some(screen) = screen.filter(|_| rows <= screen::MAX_ACT_ROWS) {
        // Screening needs only one pass.
        let acts4 = QuantizedRows::new(pool, isa, &x[..rows * k], rows, k, 32, 1);
        screen::argmax(pool, isa, &acts, &acts4, w, screen, out);
        return;
    }
    let tasks = (pool.threads() * 4).min(n.div_ceil(16)).max(1);
    let chunk = n.div_ceil(tasks);
    // Per task and row: (best value, its index, whether a non-finite value was seen).
    let mut best = vec![(f32::NEG_INFINITY, usize::MAX, false); tasks * rows];
    let best_ptr = SharedMut(best.as_mut_ptr());
    pool.run(tasks, &|t| {
        let range = t * chunk..((t + 1) * chunk).min(n);
        // SAFETY: entries t * rows .. (t + 1) * rows are written by task t only.
        let mine = unsafe { std::slice::from_raw_parts_mut(best_ptr.ptr().add(t * rows), rows) };
        products(isa, w, &acts, range, |r, j, v| {
            let b = &mut mine[r];
            if !v.is_finite() {
                b.2 = true;
            } else if v > b.0 || b.1 == usize::MAX {
                *b = (v, j, b.2);
            }
        });
    });
    crate::kernels::reduce_argmax(&best, tasks, rows, out);
}

#[cfg(test)]
mod tests;
