//! The weight store: every tensor of the model file, kept in its packed block form, once.

use std::collections::HashMap;
use std::sync::Arc;

use kiln_gguf::GgufFile;
use kiln_quant::GgmlType;

use crate::RuntimeError;

/// Index of a tensor in the [`WeightStore`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WeightId(pub usize);

/// A tensor seen as a matrix of `n_rows` rows of `row_len` elements (a vector has one row).
#[derive(Clone, Debug, PartialEq)]
pub struct WeightInfo {
    /// Tensor name.
    pub name: String,
    /// Block format.
    pub ty: GgmlType,
    /// Elements per row (ggml's `ne0`).
    pub row_len: usize,
    /// Number of rows (product of the other dimensions).
    pub n_rows: usize,
    /// Dimensions as the file gives them (ggml order).
    pub dims: Vec<usize>,
}

impl WeightInfo {
    /// Whether the tensor is one-dimensional.
    pub fn is_vector(&self) -> bool {
        self.dims.len() == 1
    }
}

/// All tensors of a model file, memory-mapped and kept packed; shared by every plan.
pub struct WeightStore {
    file: Arc<GgufFile>,
    infos: Vec<WeightInfo>,
    index: HashMap<String, WeightId>,
}

impl WeightStore {
    /// Indexes every tensor of `file`.
    pub fn new(file: Arc<GgufFile>) -> Result<Self, RuntimeError> {
        let mut infos = Vec::with_capacity(file.tensors().len());
        let mut index = HashMap::new();
        for t in file.tensors() {
            if t.dims.is_empty() || t.dims.len() > 4 {
                return Err(RuntimeError::WeightRank { name: t.name.clone(), dims: t.dims.len() });
            }
            let dims: Vec<usize> = t.dims.iter().map(|&d| d as usize).collect();
            index.insert(t.name.clone(), WeightId(infos.len()));
            infos.push(WeightInfo { name: t.name.clone(), ty: t.ty, row_len: dims[0], n_rows: dims[1..].iter().product(), dims });
        }
        Ok(WeightStore { file, infos, index })
    }

    /// The id of the tensor called `name`.
    pub fn id(&self, name: &str) -> Option<WeightId> {
        self.index.get(name).copied()
    }

    /// Shape and format of a tensor.
    pub fn info(&self, id: WeightId) -> &WeightInfo {
        &self.infos[id.0]
    }

    /// Every tensor's info, by id.
    pub fn infos(&self) -> &[WeightInfo] {
        &self.infos
    }

    /// Drops the resident pages of `bytes` (a view of a tensor's data) when the file is mapped;
    /// see [`GgufFile::release_pages`].
    pub fn release_pages(&self, bytes: &[u8]) -> bool {
        self.file.release_pages(bytes)
    }

    /// The packed bytes of a tensor (a view of the mapped file).
    pub fn bytes(&self, id: WeightId) -> &[u8] {
        // Ids are indices into the file's tensor table (see `new`).
        self.file.tensor_data(&self.file.tensors()[id.0])
    }
}
