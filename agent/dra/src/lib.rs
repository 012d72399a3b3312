//! gpuvisor-dra: the Kubernetes Dynamic Resource Allocation node component of gpuvisor.
//!
//! A local JSON-RPC client of the agent (it never touches sysfs): it publishes the host's GPUs
//! as ResourceSlices ([`model`], [`publish`]), serves the kubelet's DRA plugin
//! ([`plugin`]: registration, DRA v1 and v1beta1, resource health), prepares and unprepares
//! claims through the agent's `claim.*` methods ([`prepare`]) for the ResourceClaim as the
//! claim's external owner, and keeps the agent told which ResourceClaims exist ([`sync`]).
//! `docs/kubernetes.md` is the guide.

#![cfg_attr(not(test), deny(clippy::unwrap_used))]

pub mod agent;
pub mod cdi;
pub mod model;
pub mod plugin;
pub mod prepare;
pub mod proto;
pub mod publish;
pub mod sync;
