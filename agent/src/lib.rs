//! # gpuvisor agent
//!
//! The library core of the `gpuvisor` binary: lifecycle, device backends, store,
//! hypervisor drivers and the JSON-RPC surface. Layers (data flows down, nothing below
//! calls up): `rpc`/`cli` → `instances` → `policy glue` → `devices` / `hypervisor` →
//! `store` / `host`. Only [`host`] spells `/sys`, `/dev` and `/proc`.

// No unwrap() outside tests (docs/design/style.md): a panic is a crash.
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

pub mod cli;
pub mod config;
pub mod console;
pub mod devices;
pub mod disks;
#[cfg(test)]
mod doc_sync;
pub mod doctor;
pub mod domain;
pub mod error;
pub mod events;
pub mod failpoints;
pub mod host;
pub mod hypervisor;
pub mod images;
pub mod instances;
pub mod metrics;
pub mod names;
pub mod network;
pub mod own_file;
pub mod policies;
pub mod rpc;
pub mod serial_relay;
pub mod store;
pub mod sync;
pub mod wire;
