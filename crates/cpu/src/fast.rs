//! The fast kernels: activations quantized to 16-bit integer blocks per row (blocks of 32 for the
//! 32-element formats, of 256 with per-16 sums for the K-quants; see `act`), weights decoded block by block straight from
//! their packed GGUF bytes into integer levels and scales, and integer dot products (AVX2
//! `maddubs`/`madd`, or scalar).
//!
//! Each weight format has one block decoder (per instruction set) into one of two families, and
//! each family has one integer dot core that multiplies one weight row with up to [`ROW_GROUP`]
//! activation rows at once: a decoded block is used by every row of the group before the next is
//! read, so prefill decodes each weight row once per group and decode streams the weights once.
//! Formats without a decoder (F32, F16, BF16, Q4_1, Q5_1, Q8_K) run the exact kernels instead (see
//! [`supports`]).

mod act;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "aarch64")]
mod neon;
mod scalar;
mod screen;

use kiln_quant::GgmlType;

use crate::kernels::SharedMut;
use crate::pool::ThreadPool;
use crate::simd::Isa;
use crate::weights::PackedMatrix;

pub use act::QuantizedRows;
pub use screen::make_copy as make_screening_copy;
pub use screen::TOP_K_CANDIDATES;

/// Activation rows multiplied with each decoded weight block at once (prefill decodes each weight
/// row once per group; batched decode of up to this many sequences streams the weights once).
pub const ROW_GROUP: usize = 8;

/// Which decoded representation (and activation blocks) a weight format uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// 32-element blocks: signed levels and one f32 scale per block (Q4_0, Q5_0, Q8_0);
    /// 32-element activation blocks.
    Legacy,
    /// 256-element super-blocks: unsigned levels, integer scales and corrections per 16 elements,
    /// two f32 scales per super-block (Q2_K..Q6_K); 256-element activation blocks.
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

/// One activation row quantized to 16-bit integer blocks.
#[derive(Clone, Copy)]
pub struct ActRow<'a> {
    /// Levels, `k` of them.
    pub qs: &'a [i16],
    /// A lone K-quant row on AVX2: each level's high byte, `q >> 8` (so `q = 256 · hi + lo`), the
    /// signed operand of `maddubs`; empty otherwise.
    pub hi: &'a [i8],
    /// Each level's low byte, `q & 255` (unsigned), beside [`ActRow::hi`]; empty otherwise.
    pub lo: &'a [u8],
    /// One scale per block.
    pub d: &'a [f32],
    /// Sums of the levels of every 16 elements (K-quant rows; empty for 32-block rows).
    pub sums: &'a [f32],
}

/// Up to [`ROW_GROUP`] activation rows multiplied with each weight row together.
#[derive(Clone, Copy)]
pub struct ActGroup<'a> {
    /// The rows; past `len`, the last row again.
    pub rows: [ActRow<'a>; ROW_GROUP],
    /// Rows that count.
    pub len: usize,
    /// The rows' block scales block-major: `d_t[ROW_GROUP · b + i]` is row `i`'s scale of block `b`
    /// (so a kernel scales several rows' sums with one vector load). Only x86's legacy kernels
    /// read them: empty for K-quant activations.
    #[cfg(target_arch = "x86_64")]
    pub d_t: &'a [f32],
}

/// One K-quant super-block unpacked for the integer cores (on the stack, next to its use).
pub struct KBlock {
    /// Unsigned levels (0..=63).
    pub q: [u8; 256],
    /// Scale per 16 elements.
    pub sc: [i16; 16],
    /// Correction per 16 elements, multiplied by the activations' 16-sums.
    pub corr: [i16; 16],
    /// Super-block scale.
    pub d: f32,
    /// The multiplier of the corrections (`dmin`, or `d` for offset formats).
    pub dcorr: f32,
}

impl Default for KBlock {
    fn default() -> Self {
        KBlock { q: [0; 256], sc: [0; 16], corr: [0; 16], d: 0.0, dcorr: 0.0 }
    }
}

impl KBlock {
    /// Reads super-block `b` (format `ty`) for the in-register decoders: Q4_K/Q5_K's scales, mins
    /// and both super-block scales, Q6_K's scales and `d` (their levels are decoded in registers);
    /// the other K-quants are unpacked whole by the portable code. (Inlined: a call inside a
    /// kernel's super-block loop would spill every vector accumulator around it.)
    #[inline(always)]
    pub fn read(&mut self, ty: GgmlType, b: &[u8]) {
        let f16_at = |at: usize| kiln_quant::f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]));
        match ty {
            GgmlType::Q4_K | GgmlType::Q5_K => {
                (self.d, self.dcorr) = (f16_at(0), f16_at(2));
                let (sc, m) = kiln_quant::unpack_scale_min_k4(&b[4..16]);
                for g in 0..16 {
                    self.sc[g] = i16::from(sc[g / 2]);
                    self.corr[g] = i16::from(m[g / 2]);
                }
            }
            GgmlType::Q6_K => {
                self.d = f16_at(208);
                for (g, sc) in self.sc.iter_mut().enumerate() {
                    *sc = i16::from(b[192 + g] as i8);
                }
            }
            _ => scalar::unpack_k(ty, b, self),
        }
    }
}

/// Products of one packed weight row `src` (format `ty`, family `fam`) with the activation rows
/// of `acts`: `out[i] = acts.rows[i] · row` for `i < acts.len`. Each weight block is decoded once,
/// in registers, and multiplied with every activation row.
fn row_dot(isa: Isa, ty: GgmlType, fam: Family, src: &[u8], acts: &ActGroup<'_>) -> [f32; ROW_GROUP] {
    let mut out = [0f32; ROW_GROUP];
    macro_rules! call {
        ($r:literal) => {{
            let a: &[ActRow<'_>; $r] = acts.rows[..$r].try_into().expect("a group of $r rows");
            let res: [f32; $r] = match (fam, isa) {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: Avx2Fma is only chosen on CPUs that have it; row lengths agree.
                (Family::Legacy, Isa::Avx2Fma) => unsafe { avx2::legacy_rows(ty, src, a, acts.d_t) },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: as above.
                (Family::KQuant, Isa::Avx2Fma) => unsafe { avx2::k_rows(ty, src, a) },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: Avx512 is only chosen on CPUs that have it (and AVX2); row lengths agree.
                (Family::Legacy, Isa::Avx512) => unsafe { avx2::legacy_rows_avx512(ty, src, a, acts.d_t) },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: as above.
                (Family::KQuant, Isa::Avx512) => unsafe { avx2::k_rows_avx512(ty, src, a) },
                #[cfg(target_arch = "aarch64")]
                // SAFETY: NEON is part of every aarch64 CPU; row lengths agree.
                (Family::Legacy, Isa::Neon) => unsafe { neon::legacy_rows(ty, src, a) },
                #[cfg(target_arch = "aarch64")]
                // SAFETY: as above.
                (Family::KQuant, Isa::Neon) => unsafe { neon::k_rows(ty, src, a) },
                (Family::Legacy, _) => scalar::legacy_rows(ty, src, a),
                (Family::KQuant, _) => scalar::k_rows(ty, src, a),
            };
            out[..$r].copy_from_slice(&res);
        }};
    }
    match acts.len {
        1 => call!(1),
        2 => call!(2),
        3 => call!(3),
        4 => call!(4),
        5 => call!(5),
        6 => call!(6),
        7 => call!(7),
        _ => call!(8),
    }
    out
}

/// Weight rows per cache tile: about 16 KiB of packed weights, 1..=64 rows.
fn tile_rows(row_bytes: usize) -> usize {
    (16384 / row_bytes.max(1)).clamp(1, 64)
}

/// Calls `emit(row, col, x[row] · w[col])` for every activation row and every weight row in `cols`.
/// Weight rows are taken a cache tile at a time; every group of activation rows runs over the tile.
fn products(isa: Isa, w: &PackedMatrix<'_>, acts: &QuantizedRows, cols: std::ops::Range<usize>, mut emit: impl FnMut(usize, usize, f32)) {
    let fam = family(w.ty).expect("a fast format");
    let tr = tile_rows(w.row(0).len());
    let rows = acts.rows();
    let groups: Vec<(usize, ActGroup<'_>)> =
        (0..rows).step_by(ROW_GROUP).map(|r0| (r0, acts.group(r0, ROW_GROUP.min(rows - r0)))).collect();
    let mut c0 = cols.start;
    while c0 < cols.end {
        let tile = c0..(c0 + tr).min(cols.end);
        for (r0, group) in &groups {
            for j in tile.clone() {
                let res = row_dot(isa, w.ty, fam, w.row(j), group);
                for (i, &v) in res[..group.len].iter().enumerate() {
                    emit(r0 + i, j, v);
                }
            }
        }
        c0 = tile.end;
    }
}

/// `out[r, j] = q16(x[r, :]) · w[j, :]` for `rows` rows; `w` must be a fast format.
pub fn matmul(pool: &ThreadPool, isa: Isa, x: &[f32], rows: usize, w: &PackedMatrix<'_>, out: &mut [f32]) {
    let (k, n) = (w.k, w.n);
    let fam = family(w.ty).expect("a fast format");
    let acts = QuantizedRows::new(pool, isa, &x[..rows * k], rows, k, fam);
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

/// Each of `rows` activation rows' best `keep` products `q16(x[r, :]) · w[j, :]` as `(value, j)`,
/// best first (the lower index first among equals), found through w's screening copy `screen`
/// (see `screen::best`: in practice the products' best); `None` for a row with a non-finite value.
/// `w` must be a fast format.
pub fn screened_best(
    pool: &ThreadPool,
    isa: Isa,
    x: &[f32],
    rows: usize,
    w: &PackedMatrix<'_>,
    screen: &[u8],
    keep: usize,
) -> Vec<Option<Vec<(f32, usize)>>> {
    let k = w.k;
    let fam = family(w.ty).expect("a fast format");
    let mut best = Vec::with_capacity(rows);
    for xs in x[..rows * k].chunks(screen::MAX_ACT_ROWS * k) {
        let acts = QuantizedRows::new(pool, isa, xs, xs.len() / k, k, fam);
        best.extend(screen::best(pool, isa, xs, &acts, w, screen, keep));
    }
    best
}

/// `out[r] = argmax_j q16(x[r, :]) · w[j, :]` (lowest index among equal maxima), without storing
/// the products; `-1` when any product is not finite. `w` must be a fast format. With `screen`
/// (the bytes of w's screening copy, from [`make_screening_copy`]), only the copy's best candidates
/// are scored with `w` (see `screen`), a few rows at a time. Returns how many rows of `w` it read.
pub fn matmul_argmax(
    pool: &ThreadPool,
    isa: Isa,
    x: &[f32],
    rows: usize,
    w: &PackedMatrix<'_>,
    screen: Option<&[u8]>,
    out: &mut [i32],
) -> usize {
    let (k, n) = (w.k, w.n);
    let fam = family(w.ty).expect("a fast format");
    if let Some(screen) = screen {
        for (o, best) in out.iter_mut().zip(screened_best(pool, isa, x, rows, w, screen, screen::CANDIDATES)) {
            *o = best.map_or(-1, |b| b[0].1 as i32);
        }
        return rows * screen::CANDIDATES;
    }
    let acts = QuantizedRows::new(pool, isa, &x[..rows * k], rows, k, fam);
    let threads = pool.threads();
    // Per participating thread and row: (best value, its index, whether a non-finite value was seen).
    let mut best = vec![(f32::NEG_INFINITY, usize::MAX, false); threads * rows];
    let best_ptr = SharedMut(best.as_mut_ptr());
    pool.for_chunks_with(n, 16, &|p, range| {
        // SAFETY: entries p * rows .. (p + 1) * rows belong to participant p, whose chunks run one
        // after another on one thread.
        let mine = unsafe { std::slice::from_raw_parts_mut(best_ptr.ptr().add(p * rows), rows) };
        products(isa, w, &acts, range, |r, j, v| {
            let b = &mut mine[r];
            if !v.is_finite() {
                b.2 = true;
            } else if v > b.0 || b.1 == usize::MAX {
                *b = (v, j, b.2);
            }
        });
    });
    crate::kernels::reduce_argmax(&best, threads, rows, out);
    n
}

#[cfg(test)]
mod tests;
