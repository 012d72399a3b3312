//! # sync — the lock helper
//!
//! Every mutex in the agent guards data that stays consistent across a panic (a panic is a
//! crash in release builds, `panic = "abort"`), so a poisoned lock is taken as it is.

use std::sync::{Mutex, MutexGuard};

/// Locks `m`, ignoring poisoning.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
