//! ABI v1: policy plugins as WebAssembly core modules that exchange JSON through their
//! linear memory (docs/plugins.md "The ABI (version 1)", the SDK's `abi` module).
//!
//! What this module adds to the one plugin host ([`crate::Plugin`]): the load-time checks
//! of a module (its one import `gpuvisor.log(i32, i32, i32)`, its exports and their
//! types), linking that import, and the guest side of a call: the load's
//! `gpuvisor_abi_version` and `gpuvisor_manifest`, the input copied into the guest's
//! memory through `gpuvisor_alloc`, the entry point called, its `(ptr << 32) | len` result
//! unpacked and the reply copied out (size limit first, bounds second), the reply envelope
//! decoded. Everything else — fuel, the memory limiter, the epoch deadline, the input size
//! limit, the per-call store and instance, the log budget, error classification and stats —
//! is the host's one sequence in `plugin.rs`.

use crate::error::{CallError, LoadError};
use crate::plugin::{classify, CallState, Limits, LogLevel, LOG_LINE_MAX_BYTES};
use crate::text::{self, MAX_TEXT_BYTES};
use gpuvisor_sdk::abi::unpack;
use gpuvisor_sdk::{PolicyKind, Reply, ABI_VERSION};
use serde::de::DeserializeOwned;
use std::path::Path;
use wasmtime::{Caller, Engine, ExternType, FuncType, Instance, InstancePre, Linker, Module, Store, TypedFunc};

/// Longest manifest accepted, bytes.
const MAX_MANIFEST_BYTES: usize = 64 << 10;

// ---------------------------------------------------------------------------------------
// load-time checks and linking

/// Checks a compiled module — only the `gpuvisor.log` import, every base export with its
/// type — and links it. Errors: [`LoadError`] naming the import or export, or `Compile`
/// when linking fails.
pub(crate) fn compile(engine: &Engine, path: &Path, module: &Module) -> Result<InstancePre<CallState>, LoadError> {
    check_imports(path, module)?;
    for (export, check, expected) in BASE_EXPORTS {
        check_export(path, module, export, *check, expected)?;
    }
    link(engine, module).map_err(|e| LoadError::Compile { path: path.to_path_buf(), reason: format!("{e:#}") })
}

/// Only `gpuvisor.log(i32, i32, i32)`: a WASI import is [`LoadError::WasiImport`], any other
/// [`LoadError::ForbiddenImport`].
fn check_imports(path: &Path, module: &Module) -> Result<(), LoadError> {
    for import in module.imports() {
        let (m, n) = (import.module(), import.name());
        let allowed = (m, n) == gpuvisor_sdk::abi::LOG_IMPORT
            && matches!(import.ty(), ExternType::Func(ref f) if sig_is(f, &[I32, I32, I32], &[]));
        if allowed {
            continue;
        }
        if m.starts_with("wasi") {
            return Err(LoadError::WasiImport { path: path.to_path_buf(), module: m.to_string(), name: n.to_string() });
        }
        return Err(LoadError::ForbiddenImport {
            path: path.to_path_buf(),
            module: m.to_string(),
            name: n.to_string(),
        });
    }
    Ok(())
}

#[derive(Clone, Copy)]
enum Ty {
    I32,
    I64,
}
use Ty::{I32, I64};

#[derive(Clone, Copy)]
enum ExportCheck {
    Memory,
    Func(&'static [Ty], &'static [Ty]),
}

/// The exports every module has besides its entry points, with their types and the type a
/// refusal names (the SDK's `abi::BASE_EXPORTS`, in its order).
const BASE_EXPORTS: &[(&str, ExportCheck, &str)] = &[
    ("memory", ExportCheck::Memory, "a linear memory"),
    ("gpuvisor_abi_version", ExportCheck::Func(&[], &[I32]), "func () -> i32"),
    ("gpuvisor_alloc", ExportCheck::Func(&[I32], &[I32]), "func (i32) -> i32"),
    ("gpuvisor_free", ExportCheck::Func(&[I32, I32], &[]), "func (i32, i32)"),
    ("gpuvisor_manifest", ExportCheck::Func(&[], &[I64]), "func () -> i64"),
];

/// Checks that `module` exports the entry point of `kind`: `gpuvisor_<kind>(i32, i32) -> i64`.
pub(crate) fn check_entry_point(path: &Path, module: &Module, kind: PolicyKind) -> Result<(), LoadError> {
    check_export(path, module, kind.export_name(), ExportCheck::Func(&[I32, I32], &[I64]), "func (i32, i32) -> i64")
}

fn check_export(
    path: &Path,
    module: &Module,
    export: &'static str,
    check: ExportCheck,
    expected: &'static str,
) -> Result<(), LoadError> {
    let Some(ty) = module.get_export(export) else {
        return Err(LoadError::MissingExport { path: path.to_path_buf(), export, expected });
    };
    let ok = match (check, &ty) {
        (ExportCheck::Memory, ExternType::Memory(m)) => !m.is_64() && !m.is_shared(),
        (ExportCheck::Func(params, results), ExternType::Func(f)) => sig_is(f, params, results),
        _ => false,
    };
    if ok {
        Ok(())
    } else {
        Err(LoadError::ExportType { path: path.to_path_buf(), export, expected })
    }
}

fn sig_is(f: &FuncType, params: &[Ty], results: &[Ty]) -> bool {
    fn same(actual: impl ExactSizeIterator<Item = wasmtime::ValType>, want: &[Ty]) -> bool {
        actual.len() == want.len()
            && actual.zip(want).all(|(a, w)| match w {
                Ty::I32 => a.is_i32(),
                Ty::I64 => a.is_i64(),
            })
    }
    same(f.params(), params) && same(f.results(), results)
}

/// Links the one import, `gpuvisor.log`, to [`host_log`].
fn link(engine: &Engine, module: &Module) -> wasmtime::Result<InstancePre<CallState>> {
    let mut linker: Linker<CallState> = Linker::new(engine);
    let (import_module, import_name) = gpuvisor_sdk::abi::LOG_IMPORT;
    linker.func_wrap(import_module, import_name, host_log)?;
    linker.instantiate_pre(module)
}

// ---------------------------------------------------------------------------------------
// calls: the guest's memory in and out

/// In a fresh `instance`: `gpuvisor_abi_version`, then — when it is [`ABI_VERSION`] —
/// `gpuvisor_manifest`'s bytes (at most [`MAX_MANIFEST_BYTES`]); another version comes back
/// with no bytes, for the caller to refuse.
pub(crate) fn manifest(
    store: &mut Store<CallState>,
    instance: &Instance,
    label: &str,
    kind: PolicyKind,
    limits: &Limits,
) -> Result<(i32, Vec<u8>), CallError> {
    let abi: TypedFunc<(), i32> = typed(instance, store, "gpuvisor_abi_version", label, kind)?;
    let version = abi.call(&mut *store, ()).map_err(|e| classify(e, store, label, kind, limits))?;
    if version != ABI_VERSION {
        return Ok((version, Vec::new()));
    }
    let manifest: TypedFunc<(), i64> = typed(instance, store, "gpuvisor_manifest", label, kind)?;
    let packed = manifest.call(&mut *store, ()).map_err(|e| classify(e, store, label, kind, limits))?;
    let bytes = read_reply(store, instance, packed, MAX_MANIFEST_BYTES, "gpuvisor_manifest", label, kind)?;
    Ok((version, bytes))
}

/// In a fresh `instance`: `input` (JSON, within the input limit) copied into a buffer of
/// `gpuvisor_alloc`, the `kind`'s entry point called on it, and the reply's bytes (at most
/// `limits.max_output_bytes`).
pub(crate) fn call(
    store: &mut Store<CallState>,
    instance: &Instance,
    label: &str,
    kind: PolicyKind,
    limits: &Limits,
    input: &[u8],
) -> Result<Vec<u8>, CallError> {
    let alloc: TypedFunc<i32, i32> = typed(instance, store, "gpuvisor_alloc", label, kind)?;
    let len = i32::try_from(input.len()).map_err(|_| CallError::InputTooLarge {
        plugin: label.to_string(),
        kind,
        len: input.len(),
        max: limits.max_input_bytes,
    })?;
    let ptr = alloc.call(&mut *store, len).map_err(|e| classify(e, store, label, kind, limits))?;
    let memory = memory(instance, store, label, kind)?;
    let bad_alloc = |store: &Store<CallState>| {
        if store.data().memory_hit() {
            CallError::MemoryLimit { plugin: label.to_string(), kind, limit_bytes: limits.memory_bytes }
        } else {
            CallError::BadPointer {
                plugin: label.to_string(),
                kind,
                what: "gpuvisor_alloc",
                ptr: ptr as u32,
                len: len as u32,
            }
        }
    };
    if ptr == 0 && len > 0 {
        return Err(bad_alloc(store));
    }
    if memory.write(&mut *store, ptr as u32 as usize, input).is_err() {
        return Err(bad_alloc(store));
    }
    let entry: TypedFunc<(i32, i32), i64> = typed(instance, store, kind.export_name(), label, kind)?;
    let packed = entry.call(&mut *store, (ptr, len)).map_err(|e| classify(e, store, label, kind, limits))?;
    read_reply(store, instance, packed, limits.max_output_bytes, kind.export_name(), label, kind)
}

/// The reply envelope: `{"ok": <answer>}` is the answer as `T`; `{"error": "message"}` is
/// [`CallError::Plugin`]; anything else [`CallError::UndecodableReply`].
pub(crate) fn answer<T: DeserializeOwned>(reply: &[u8], label: &str, kind: PolicyKind) -> Result<T, CallError> {
    match serde_json::from_slice::<Reply<T>>(reply) {
        Ok(Reply::Ok(answer)) => Ok(answer),
        Ok(Reply::Error(message)) => {
            Err(CallError::Plugin { plugin: label.to_string(), kind, message: text::shown(&message, MAX_TEXT_BYTES) })
        }
        Err(e) => Err(CallError::UndecodableReply {
            plugin: label.to_string(),
            kind,
            // serde's message quotes the plugin's own text (e.g. an unknown variant).
            reason: text::shown(
                &format!("expected {{\"ok\": <{} answer>}} or {{\"error\": \"message\"}}: {e}", kind.as_str()),
                MAX_TEXT_BYTES,
            ),
        }),
    }
}

fn typed<P, R>(
    instance: &Instance,
    store: &mut Store<CallState>,
    name: &'static str,
    label: &str,
    kind: PolicyKind,
) -> Result<TypedFunc<P, R>, CallError>
where
    P: wasmtime::WasmParams,
    R: wasmtime::WasmResults,
{
    // Checked at load, so this only fails if the module changed under us.
    instance.get_typed_func::<P, R>(&mut *store, name).map_err(|e| CallError::Trap {
        plugin: label.to_string(),
        kind,
        message: format!("export {name}: {e:#}"),
    })
}

fn memory(
    instance: &Instance,
    store: &mut Store<CallState>,
    label: &str,
    kind: PolicyKind,
) -> Result<wasmtime::Memory, CallError> {
    instance.get_memory(&mut *store, "memory").ok_or_else(|| CallError::Trap {
        plugin: label.to_string(),
        kind,
        message: "export memory is missing".into(),
    })
}

/// Copies the `(ptr << 32) | len` buffer out of the instance's memory, checking the size
/// limit first and the bounds second.
fn read_reply(
    store: &mut Store<CallState>,
    instance: &Instance,
    packed: i64,
    max: usize,
    what: &'static str,
    label: &str,
    kind: PolicyKind,
) -> Result<Vec<u8>, CallError> {
    let (ptr, len) = unpack(packed);
    if len as usize > max {
        return Err(CallError::OutputTooLarge { plugin: label.to_string(), kind, len: len as usize, max });
    }
    let memory = memory(instance, store, label, kind)?;
    let data = memory.data(&*store);
    let start = ptr as usize;
    match start.checked_add(len as usize).and_then(|end| data.get(start..end)) {
        Some(bytes) => Ok(bytes.to_vec()),
        None => Err(CallError::BadPointer { plugin: label.to_string(), kind, what, ptr, len }),
    }
}

// ---------------------------------------------------------------------------------------
// the log import

/// `gpuvisor.log(level, ptr, len)`: one line to the log ([`crate::plugin::CallLog::line`]). Never traps:
/// an unreadable line is dropped and counted.
fn host_log(mut caller: Caller<'_, CallState>, level: i32, ptr: i32, len: i32) {
    let Some(memory) = caller.get_export("memory").and_then(|e| e.into_memory()) else {
        caller.data_mut().log.unreadable();
        return;
    };
    let data = memory.data(&caller);
    let start = ptr as u32 as usize;
    let len = (len as u32 as usize).min(LOG_LINE_MAX_BYTES);
    let Some(bytes) = start.checked_add(len).and_then(|end| data.get(start..end)) else {
        caller.data_mut().log.unreadable();
        return;
    };
    let line = String::from_utf8_lossy(bytes).into_owned();
    let level = match level {
        0 => LogLevel::Error,
        1 => LogLevel::Warn,
        2 => LogLevel::Info,
        3 => LogLevel::Debug,
        _ => LogLevel::Trace,
    };
    caller.data_mut().log.line(level, line);
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_checked_exports_are_the_sdks() {
        let names: Vec<&str> = super::BASE_EXPORTS.iter().map(|e| e.0).collect();
        assert_eq!(names, gpuvisor_sdk::abi::BASE_EXPORTS);
    }
}
