//! kiln's models: graph builders per architecture, the loaded [`Model`] with its compile cache,
//! the inference [`Session`] (one forward path for prefill and decode, parameterised by an
//! [`OutputMode`]), sampling, and the generation loop.

mod arch;
mod error;
mod gemma3;
mod generate;
mod model;
mod sampling;
pub mod synth;

pub use arch::{architecture_from_gguf, Architecture};
pub use error::ModelError;
pub use gemma3::Gemma3Config;
pub use generate::{generate, Advance, FinishReason, GenerateParams, Generation, Generator, TextControl, TokenLogprob};
pub use kiln_ir::OutputMode;
pub use model::{Model, Session, StepOutput};
pub use sampling::{Sampler, SamplingParams};
