//! # domain — what the agent's records mean, apart from how they are kept
//!
//! The lifecycle states and their transition tables ([`state`]), instances ([`instance`])
//! claims with their kinds and owners ([`claim`]) and devices' health marks ([`health`]). [`crate::store`] persists these types
//! (its files, its atomic writes, its listings); the events and the API's errors name them
//! from here, not from the store.

pub mod claim;
pub mod health;
pub mod instance;
pub mod state;

pub use claim::*;
pub use health::*;
pub use instance::*;
pub use state::*;
