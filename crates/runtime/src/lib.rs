//! kiln's runtime: the compiler from graph IR to executable plans, the compile cache, the backend
//! trait, the KV cache layout and the weight store.
//!
//! Flow: a model builder emits a [`kiln_ir::Graph`] for one bucket; [`compile`] checks it against
//! the [`WeightStore`], fuses ops, plans one arena for all activations and lowers it to a [`Plan`]
//! of [`Kernel`] steps; a [`Backend`] turns the plan into an [`Executable`] that shares the
//! device's single copy of the weights ([`DeviceWeights`]); the [`CompileCache`] keeps executables
//! per [`PlanKey`]. [`draw`] defines how a step draws a token from its logits or candidates.

mod backend;
mod cache;
mod compile;
mod config;
pub mod draw;
mod error;
mod kv;
mod plan;
mod weights;

pub use backend::{all_finite, Backend, DeviceWeights, Executable, HostData, HostTensor, KvCache, StepInputs};
pub use cache::{CompileCache, PlanKey};
pub use compile::compile;
pub use config::{EngineConfig, KernelPrecision, KvType};
pub use draw::DrawSpec;
pub use error::RuntimeError;
pub use kv::{KvLayout, LayerKv};
pub use plan::{Kernel, Plan, PlanInput, PlanOutput, Rows, Slot, Step};
pub use weights::{WeightId, WeightInfo, WeightStore};
