//! ABI v1 glue: the [`export_plugin!`](crate::export_plugin) macro, the [`log`] helper and
//! the target-independent pieces the macro expands to.
//!
//! # Writing a plugin
//!
//! ```ignore
//! use gpuvisor_sdk::{PlacementAnswer, PlacementInput};
//!
//! pub fn place(input: &PlacementInput) -> PlacementAnswer {
//!     PlacementAnswer::Reject(format!("no room for {}", input.request.profile))
//! }
//!
//! gpuvisor_sdk::export_plugin! {
//!     name: "my-placement",
//!     version: env!("CARGO_PKG_VERSION"),
//!     placement: crate::place,
//! }
//! ```
//!
//! The macro takes `name` and `version` (string expressions), then any subset of
//! `placement:`, `hypervisor:` and `grace:` **in that order**, each the path of a function
//! `fn(&XInput) -> R` where `R` is the answer type (`PlacementAnswer`, `HypervisorAnswer`,
//! `GraceAnswer`) or `Result<answer, E>` with `E: Display` (an `Err` becomes the reply
//! `{"error": "<E>"}`; the agent then fails closed, see docs/plugins.md "Failure semantics").
//!
//! The exports are generated only under `cfg(target_arch = "wasm32")`, so several plugin
//! crates can link into one native test binary; natively, test the functions directly or
//! through [`crate::testing`].
//!
//! # Memory ownership
//!
//! `gpuvisor_alloc(len)` returns a buffer of `len` bytes the host writes the input into;
//! the entry point reads it and leaves it allocated (the host may `gpuvisor_free` it). The
//! manifest and reply buffers are leaked on purpose: every call runs in a fresh instance
//! that the host throws away afterwards.
//!
//! A panic in a plugin built with `panic = "abort"` becomes a wasm trap, which the host
//! reports as a failed call.

use crate::types::{GraceAnswer, HypervisorAnswer, Manifest, PlacementAnswer, Reply};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::fmt::Display;

/// The exports every v1 module has besides its entry points
/// ([`PolicyKind::export_name`](crate::PolicyKind::export_name)), with their wasm types:
/// `memory`, `gpuvisor_abi_version() -> i32`, `gpuvisor_alloc(i32) -> i32`,
/// `gpuvisor_free(i32, i32)`, `gpuvisor_manifest() -> i64`. Every entry point is
/// `(i32, i32) -> i64`. The C header `sdk/include/gpuvisor_v1.h` declares the same names.
pub const BASE_EXPORTS: [&str; 5] =
    ["memory", "gpuvisor_abi_version", "gpuvisor_alloc", "gpuvisor_free", "gpuvisor_manifest"];

/// The only import a v1 module may have, `(module, name)`: `gpuvisor.log(i32, i32, i32)`.
pub const LOG_IMPORT: (&str, &str) = ("gpuvisor", "log");

/// Levels of the `gpuvisor.log(level, ptr, len)` import: the wire value is the enum's
/// `i32` discriminant (`0` error … `4` trace); the host maps unknown values to trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum LogLevel {
    /// `0`
    Error = 0,
    /// `1`
    Warn = 1,
    /// `2`
    Info = 2,
    /// `3`
    Debug = 3,
    /// `4`
    Trace = 4,
}

#[cfg(all(target_arch = "wasm32", not(feature = "v2")))]
#[link(wasm_import_module = "gpuvisor")]
extern "C" {
    #[link_name = "log"]
    fn gpuvisor_log(level: i32, ptr: i32, len: i32);
}

/// Sends one line to the agent's log, tagged with the plugin's name. On wasm32 this calls
/// the import `gpuvisor.log` (ABI v1), or with the feature `v2` the import
/// `gpuvisor:policy/log@2.0.0` ([`crate::v2::log`]), so a v2 component has no v1 import;
/// natively it does nothing. The host rate-limits and truncates lines (see the plugin
/// host's docs), so log decisions, not data.
pub fn log(level: LogLevel, message: &str) {
    #[cfg(feature = "v2")]
    crate::v2::log(level, message);
    #[cfg(all(target_arch = "wasm32", not(feature = "v2")))]
    // SAFETY: the host reads `len` bytes at `ptr` from this module's memory; the slice
    // is alive for the duration of the call. wasm32 pointers and lengths fit in i32.
    unsafe {
        gpuvisor_log(level as i32, message.as_ptr() as i32, message.len() as i32);
    }
    #[cfg(all(not(target_arch = "wasm32"), not(feature = "v2")))]
    {
        let _ = (level, message);
    }
}

/// Turns what a policy function returns into a reply envelope. Implemented for the three
/// answer types (always `{"ok": ..}`) and for `Result<answer, E: Display>`.
pub trait IntoReply<T> {
    /// The reply envelope.
    fn into_reply(self) -> Reply<T>;
}

macro_rules! impl_into_reply {
    ($($t:ty),*) => {$(
        impl IntoReply<$t> for $t {
            fn into_reply(self) -> Reply<$t> {
                Reply::Ok(self)
            }
        }
        impl<E: Display> IntoReply<$t> for Result<$t, E> {
            fn into_reply(self) -> Reply<$t> {
                match self {
                    Ok(answer) => Reply::Ok(answer),
                    Err(e) => Reply::Error(e.to_string()),
                }
            }
        }
    )*};
}
impl_into_reply!(PlacementAnswer, HypervisorAnswer, GraceAnswer);

/// Runs a policy function on a JSON input and returns the UTF-8 JSON reply
/// (`{"ok": answer}` or `{"error": "message"}`). An input that does not decode as `I`
/// gives `{"error": "input does not decode: ..."}`. Used by the generated entry points and
/// by [`crate::testing`], so native tests exercise the same path as the wasm build.
pub fn dispatch<I, T, R>(input: &[u8], f: impl FnOnce(&I) -> R) -> Vec<u8>
where
    I: DeserializeOwned,
    T: Serialize,
    R: IntoReply<T>,
{
    let reply: Reply<T> = match serde_json::from_slice::<I>(input) {
        Ok(decoded) => f(&decoded).into_reply(),
        Err(e) => Reply::Error(format!("input does not decode: {e}")),
    };
    encode_reply(&reply)
}

fn encode_reply<T: Serialize>(reply: &Reply<T>) -> Vec<u8> {
    match serde_json::to_vec(reply) {
        Ok(bytes) => bytes,
        Err(e) => {
            let fallback: Reply<()> = Reply::Error(format!("answer does not encode: {e}"));
            // A `Reply<()>` holding a String always serializes.
            serde_json::to_vec(&fallback).unwrap_or_else(|_| b"{\"error\":\"encode\"}".to_vec())
        }
    }
}

/// The manifest JSON for the given name, version and kinds.
pub fn manifest_json(manifest: &Manifest) -> Vec<u8> {
    serde_json::to_vec(manifest).unwrap_or_else(|_| b"{}".to_vec())
}

/// Packs a pointer and a length into the ABI's `i64`: `(ptr << 32) | len`.
pub fn pack(ptr: u32, len: u32) -> i64 {
    (((ptr as u64) << 32) | len as u64) as i64
}

/// Splits a packed `i64` into `(ptr, len)`; the inverse of [`pack`].
pub fn unpack(packed: i64) -> (u32, u32) {
    let v = packed as u64;
    ((v >> 32) as u32, v as u32)
}

/// Implementation details of the generated exports (wasm32 only). Not a stable API.
#[cfg(target_arch = "wasm32")]
#[doc(hidden)]
pub mod __rt {
    use std::alloc::{alloc, dealloc, Layout};

    /// `gpuvisor_alloc`: a `len`-byte buffer, `0` when `len` is negative or allocation
    /// fails (the host reports a bad pointer).
    pub fn alloc_buf(len: i32) -> i32 {
        if len < 0 {
            return 0;
        }
        if len == 0 {
            return 1; // a dangling, never dereferenced, non-null pointer
        }
        match Layout::array::<u8>(len as usize) {
            // SAFETY: the layout has a non-zero size.
            Ok(layout) => unsafe { alloc(layout) as i32 },
            Err(_) => 0,
        }
    }

    /// `gpuvisor_free`: frees a buffer returned by `alloc_buf(len)`.
    ///
    /// # Safety
    /// `ptr` must come from `alloc_buf(len)` with the same `len` and not be freed yet.
    pub unsafe fn free_buf(ptr: i32, len: i32) {
        if ptr == 0 || len <= 0 {
            return;
        }
        if let Ok(layout) = Layout::array::<u8>(len as usize) {
            // SAFETY: the caller passes a buffer `alloc_buf(len)` returned, with this layout.
            unsafe { dealloc(ptr as *mut u8, layout) };
        }
    }

    /// Leaks `bytes` and returns their packed location.
    pub fn leak(bytes: Vec<u8>) -> i64 {
        let bytes = bytes.into_boxed_slice();
        let len = bytes.len() as u32;
        let ptr = Box::leak(bytes).as_ptr() as u32;
        super::pack(ptr, len)
    }

    /// The input bytes at `(ptr, len)`.
    ///
    /// # Safety
    /// `(ptr, len)` must be a buffer the host filled after `gpuvisor_alloc(len)`.
    pub unsafe fn input<'a>(ptr: i32, len: i32) -> &'a [u8] {
        if len <= 0 {
            return &[];
        }
        // SAFETY: the caller passes a buffer of `len` bytes the host filled.
        unsafe { std::slice::from_raw_parts(ptr as *const u8, len as usize) }
    }
}

/// Refuses `export_plugin!` when the SDK's feature `v2` is on: [`log`] then calls the v2
/// import, which a v1 module may not have (the agent would refuse it at load).
#[cfg(feature = "v2")]
#[doc(hidden)]
#[macro_export]
macro_rules! __gpuvisor_require_v1 {
    () => {
        ::core::compile_error!(
            "export_plugin! (ABI v1) with gpuvisor-sdk's feature `v2` on: use export_plugin_v2!, \
             or build without the feature (cargo feature unification: a v1 and a v2 build of \
             the plugins need separate cargo invocations)"
        );
    };
}

/// Without the feature `v2`: nothing to refuse.
#[cfg(not(feature = "v2"))]
#[doc(hidden)]
#[macro_export]
macro_rules! __gpuvisor_require_v1 {
    () => {};
}

/// Generates the ABI v1 exports of a plugin (wasm32 only). See the [module docs](self).
///
/// ```ignore
/// gpuvisor_sdk::export_plugin! {
///     name: "grace-default",
///     version: env!("CARGO_PKG_VERSION"),
///     grace: crate::decide,
/// }
/// ```
#[macro_export]
macro_rules! export_plugin {
    (
        name: $name:expr,
        version: $version:expr
        $(, placement: $placement:path)?
        $(, hypervisor: $hypervisor:path)?
        $(, grace: $grace:path)?
        $(,)?
    ) => {
        #[cfg(target_arch = "wasm32")]
        #[doc(hidden)]
        pub mod __gpuvisor_plugin_exports {
            #[allow(unused_imports)]
            use super::*;

            $crate::__gpuvisor_require_v1!();

            #[unsafe(no_mangle)]
            pub extern "C" fn gpuvisor_abi_version() -> i32 {
                $crate::ABI_VERSION
            }

            #[unsafe(no_mangle)]
            pub extern "C" fn gpuvisor_alloc(len: i32) -> i32 {
                $crate::abi::__rt::alloc_buf(len)
            }

            /// # Safety
            /// `ptr` comes from `gpuvisor_alloc(len)`.
            #[unsafe(no_mangle)]
            pub unsafe extern "C" fn gpuvisor_free(ptr: i32, len: i32) {
                // SAFETY: the host passes back a buffer gpuvisor_alloc(len) returned.
                unsafe { $crate::abi::__rt::free_buf(ptr, len) }
            }

            #[unsafe(no_mangle)]
            pub extern "C" fn gpuvisor_manifest() -> i64 {
                #[allow(unused_mut)]
                let mut kinds = ::std::vec::Vec::new();
                $( let _ = $placement; kinds.push($crate::PolicyKind::Placement); )?
                $( let _ = $hypervisor; kinds.push($crate::PolicyKind::Hypervisor); )?
                $( let _ = $grace; kinds.push($crate::PolicyKind::Grace); )?
                let manifest = $crate::Manifest {
                    name: ::std::string::String::from($name),
                    version: ::std::string::String::from($version),
                    kinds,
                };
                $crate::abi::__rt::leak($crate::abi::manifest_json(&manifest))
            }

            $(
            /// # Safety
            /// `(ptr, len)` is a buffer the host filled after `gpuvisor_alloc(len)`.
            #[unsafe(no_mangle)]
            pub unsafe extern "C" fn gpuvisor_placement(ptr: i32, len: i32) -> i64 {
                // SAFETY: the host filled (ptr, len) after gpuvisor_alloc(len).
                let input = unsafe { $crate::abi::__rt::input(ptr, len) };
                $crate::abi::__rt::leak($crate::abi::dispatch::<$crate::PlacementInput, $crate::PlacementAnswer, _>(input, $placement))
            }
            )?

            $(
            /// # Safety
            /// `(ptr, len)` is a buffer the host filled after `gpuvisor_alloc(len)`.
            #[unsafe(no_mangle)]
            pub unsafe extern "C" fn gpuvisor_hypervisor(ptr: i32, len: i32) -> i64 {
                // SAFETY: the host filled (ptr, len) after gpuvisor_alloc(len).
                let input = unsafe { $crate::abi::__rt::input(ptr, len) };
                $crate::abi::__rt::leak($crate::abi::dispatch::<$crate::HypervisorInput, $crate::HypervisorAnswer, _>(input, $hypervisor))
            }
            )?

            $(
            /// # Safety
            /// `(ptr, len)` is a buffer the host filled after `gpuvisor_alloc(len)`.
            #[unsafe(no_mangle)]
            pub unsafe extern "C" fn gpuvisor_grace(ptr: i32, len: i32) -> i64 {
                // SAFETY: the host filled (ptr, len) after gpuvisor_alloc(len).
                let input = unsafe { $crate::abi::__rt::input(ptr, len) };
                $crate::abi::__rt::leak($crate::abi::dispatch::<$crate::GraceInput, $crate::GraceAnswer, _>(input, $grace))
            }
            )?
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::PlacementInput;

    #[test]
    fn pack_and_unpack_round_trip() {
        assert_eq!(unpack(pack(0x0011_2233, 0xffff_fff0)), (0x0011_2233, 0xffff_fff0));
        assert_eq!(pack(1, 2), (1i64 << 32) | 2);
    }

    #[test]
    fn undecodable_input_gives_an_error_reply() {
        let out = dispatch::<PlacementInput, PlacementAnswer, _>(b"{not json", |_| PlacementAnswer::Ranked(vec![]));
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert!(v["error"].as_str().unwrap().starts_with("input does not decode"));
    }

    #[test]
    fn err_result_becomes_an_error_reply() {
        let out = dispatch::<serde_json::Value, HypervisorAnswer, _>(b"{}", |_| Err::<HypervisorAnswer, _>("nope"));
        assert_eq!(out, br#"{"error":"nope"}"#);
    }
}
