//! kiln's models: graph builders per architecture, the loaded [`Model`] with its compile cache,
//! the inference [`Session`] (one forward path for prefill and decode, parameterised by an
//! [`OutputMode`]), sampling, and the generation loop.

mod arch;
mod decoder;
mod error;
mod families;
mod generate;
mod json;
mod model;
mod sampling;
pub mod synth;

pub use arch::{architecture_from_gguf, Architecture};
pub use decoder::{Activation, DecoderConfig, LayerConfig};
pub use error::ModelError;
pub use families::{config_from_gguf, SUPPORTED};
pub use generate::{generate, Advance, FinishReason, GenerateParams, Generation, Generator, TextControl, TokenLogprob};
pub use json::{JsonObjectPrefix, OutputFormat};
pub use kiln_ir::{Among, OutputMode};
pub use kiln_runtime::DrawSpec;
pub use model::{Model, Session, StepOutput};
pub use sampling::{Sampler, SamplingParams};
