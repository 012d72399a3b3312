//! # disks — disk images and per-instance overlays, through `qemu-img`
//!
//! The one place gpuvisor runs `qemu-img` (the `qemu_img_binary` config key): what a file
//! is ([`inspect`]), the copy of an imported disk into an image directory
//! ([`copy_into_image`]), and the writable qcow2 overlay of an instance on its image's disk
//! ([`create_overlay`]). Every file is written under a temporary name and renamed into
//! place, so a crash never leaves a half-written disk under its final name (the caller
//! checks for the final name to decide whether a step is done).
//!
//! **What counts as a disk.** `qemu-img info --output=json` decides the format; only
//! `qcow2` and `raw` are accepted. `qemu-img` calls every file it does not recognise `raw`,
//! so a raw file must also look like a partitioned disk: a size that is a non-zero multiple
//! of 512 bytes and the boot signature `55 AA` at byte 510 of its first sector, which every
//! MBR and every GPT disk (its protective MBR) has. A qcow2 with a backing file must have
//! that backing file; the copy into the image directory is flattened (`qemu-img convert`),
//! so an image never depends on a file outside its directory.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The disk formats an image may have.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum DiskFormat {
    /// QEMU copy-on-write v2.
    Qcow2,
    /// A raw, partitioned disk (MBR or GPT).
    Raw,
}

impl DiskFormat {
    /// `qcow2` or `raw`: `qemu-img`'s `-f`/`-F` value.
    pub fn as_str(self) -> &'static str {
        match self {
            DiskFormat::Qcow2 => "qcow2",
            DiskFormat::Raw => "raw",
        }
    }
}

impl std::fmt::Display for DiskFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What `qemu-img info` says about a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskInfo {
    /// The file's format (`format`).
    pub format: DiskFormat,
    /// The size the guest sees, bytes (`virtual-size`).
    pub virtual_size_bytes: u64,
    /// The backing file (`full-backing-filename`), if any.
    pub backing: Option<PathBuf>,
}

/// Errors of the disk operations; [`DiskError::Invalid`] is the caller's input, the rest
/// are the host's.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    /// The file is not a disk gpuvisor accepts (not found, another format, not a
    /// partitioned raw disk, a missing backing file).
    #[error("{0}")]
    Invalid(String),
    /// `qemu-img` could not be run or failed on a file gpuvisor made.
    #[error("{0}")]
    Tool(String),
}

/// Bytes of `1 GiB`.
pub const GIB: u64 = 1024 * 1024 * 1024;

/// `<qemu_img> args…`: its stdout, or its stderr's last line as the error.
fn run(qemu_img: &Path, args: &[&str]) -> Result<String, String> {
    let out =
        Command::new(qemu_img).args(args).output().map_err(|e| format!("cannot run {}: {e}", qemu_img.display()))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("").trim();
        Err(format!("{} {} failed ({}): {last}", qemu_img.display(), args.first().unwrap_or(&""), out.status))
    }
}

/// The JSON fields of `qemu-img info --output=json` gpuvisor reads.
#[derive(serde::Deserialize)]
struct QemuImgInfo {
    format: String,
    #[serde(rename = "virtual-size")]
    virtual_size: u64,
    #[serde(rename = "full-backing-filename")]
    full_backing_filename: Option<PathBuf>,
    #[serde(rename = "backing-filename")]
    backing_filename: Option<PathBuf>,
}

/// `true` when the first sector of `path` ends in the boot signature `55 AA` (MBR, or
/// GPT's protective MBR).
fn has_boot_signature(path: &Path) -> std::io::Result<bool> {
    let mut sector = [0u8; 512];
    std::fs::File::open(path)?.read_exact(&mut sector)?;
    Ok(sector[510] == 0x55 && sector[511] == 0xAA)
}

/// What `path` is, by `qemu-img info` and the rule in the module docs. Errors:
/// [`DiskError::Invalid`] naming the file and what is wrong with it; [`DiskError::Tool`]
/// when `qemu-img` cannot be run.
pub fn inspect(qemu_img: &Path, path: &Path) -> Result<DiskInfo, DiskError> {
    let meta =
        std::fs::metadata(path).map_err(|e| DiskError::Invalid(format!("cannot read disk {}: {e}", path.display())))?;
    if !meta.is_file() {
        return Err(DiskError::Invalid(format!("disk {} is not a regular file", path.display())));
    }
    let p = path.to_string_lossy();
    // `-U`: a disk in use by a running VM may still be inspected (read-only, no lock).
    let text = run(qemu_img, &["info", "--output=json", "-U", &p]).map_err(|e| {
        if e.starts_with("cannot run") {
            DiskError::Tool(e)
        } else {
            DiskError::Invalid(format!("disk {} cannot be read as a disk image: {e}", path.display()))
        }
    })?;
    let info: QemuImgInfo = serde_json::from_str(&text)
        .map_err(|e| DiskError::Tool(format!("qemu-img info of {} answered unexpected JSON: {e}", path.display())))?;
    let format = match info.format.as_str() {
        "qcow2" => DiskFormat::Qcow2,
        "raw" => DiskFormat::Raw,
        other => {
            return Err(DiskError::Invalid(format!(
                "disk {} is {other}, not qcow2 or raw (convert it with qemu-img convert -O qcow2)",
                path.display()
            )))
        }
    };
    if format == DiskFormat::Raw {
        let signed = has_boot_signature(path).unwrap_or(false);
        if meta.len() == 0 || meta.len() % 512 != 0 || !signed {
            return Err(DiskError::Invalid(format!(
                "{} is neither a qcow2 image nor a partitioned raw disk (a raw disk must be a multiple \
                 of 512 bytes with an MBR or GPT boot signature 55 AA at byte 510)",
                path.display()
            )));
        }
    }
    let backing = info.full_backing_filename.or(info.backing_filename);
    if let Some(b) = &backing {
        if !b.exists() {
            return Err(DiskError::Invalid(format!(
                "the backing file {} of disk {} is missing",
                b.display(),
                path.display()
            )));
        }
    }
    Ok(DiskInfo { format, virtual_size_bytes: info.virtual_size, backing })
}

/// The name a file is written under before it is renamed to `dst`: a fresh name in the
/// agent's private directory beside it ([`crate::hypervisor::confine::staging_path`]).
fn staging(dst: &Path) -> Result<PathBuf, DiskError> {
    crate::hypervisor::confine::staging_path(dst)
        .map_err(|e| DiskError::Tool(format!("no private directory beside {}: {e}", dst.display())))
}

/// Renames `tmp` to `dst`, or removes `tmp` when `r` failed.
fn finish(tmp: &Path, dst: &Path, r: Result<(), DiskError>) -> Result<(), DiskError> {
    let r = r.and_then(|()| {
        std::fs::rename(tmp, dst)
            .map_err(|e| DiskError::Tool(format!("cannot rename {} to {}: {e}", tmp.display(), dst.display())))
    });
    if r.is_err() {
        let _ = std::fs::remove_file(tmp);
    }
    r
}

/// Copies disk `src` (inspected as `info`) to `dst` in the same format, flattening any
/// backing chain (`qemu-img convert -f <fmt> -O <fmt>`; raw stays sparse).
pub fn copy_into_image(qemu_img: &Path, src: &Path, info: &DiskInfo, dst: &Path) -> Result<(), DiskError> {
    let tmp = staging(dst)?;
    let f = info.format.as_str();
    let r = run(qemu_img, &["convert", "-f", f, "-O", f, &src.to_string_lossy(), &tmp.to_string_lossy()])
        .map(|_| ())
        .map_err(|e| DiskError::Invalid(format!("disk {} cannot be copied: {e}", src.display())));
    finish(&tmp, dst, r)
}

/// Creates the qcow2 overlay `dst` on `base` (`qemu-img create -f qcow2 -b <base> -F <fmt>`),
/// grown to `size_bytes` when that is larger than the base (`qemu-img resize`).
pub fn create_overlay(
    qemu_img: &Path,
    base: &Path,
    format: DiskFormat,
    size_bytes: Option<u64>,
    dst: &Path,
) -> Result<(), DiskError> {
    let tmp = staging(dst)?;
    let t = tmp.to_string_lossy().into_owned();
    let r = run(qemu_img, &["create", "-q", "-f", "qcow2", "-b", &base.to_string_lossy(), "-F", format.as_str(), &t])
        .and_then(|_| match size_bytes {
            Some(s) => run(qemu_img, &["resize", "-q", "-f", "qcow2", &t, &s.to_string()]).map(|_| ()),
            None => Ok(()),
        })
        .map_err(DiskError::Tool);
    finish(&tmp, dst, r)
}

/// Copies the open file `src` (an overlay, a UEFI variable store; `what` names it in
/// errors) to `dst` through a temporary name.
pub fn copy_open(src: &mut std::fs::File, what: &Path, dst: &Path) -> Result<(), DiskError> {
    let tmp = staging(dst)?;
    let r = std::fs::File::create_new(&tmp)
        .and_then(|mut out| std::io::copy(src, &mut out))
        .map(|_| ())
        .map_err(|e| DiskError::Tool(format!("cannot copy {} to {}: {e}", what.display(), tmp.display())));
    finish(&tmp, dst, r)
}

/// Copies a file (a UEFI variable store template) to `dst` through a temporary name.
pub fn copy_file(src: &Path, dst: &Path) -> Result<(), DiskError> {
    let tmp = staging(dst)?;
    let r = std::fs::copy(src, &tmp)
        .map(|_| ())
        .map_err(|e| DiskError::Tool(format!("cannot copy {} to {}: {e}", src.display(), tmp.display())));
    finish(&tmp, dst, r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_boot_signature_is_read_at_byte_510() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("d");
        let mut s = vec![0u8; 1024];
        std::fs::write(&p, &s).unwrap();
        assert!(!has_boot_signature(&p).unwrap());
        s[510] = 0x55;
        s[511] = 0xAA;
        std::fs::write(&p, &s).unwrap();
        assert!(has_boot_signature(&p).unwrap());
    }

    #[test]
    fn staging_is_a_fresh_name_in_the_private_directory() {
        let d = tempfile::tempdir().unwrap();
        let a = staging(&d.path().join("disk.qcow2")).unwrap();
        assert!(a.starts_with(d.path().join(crate::hypervisor::confine::PRIVATE_DIR)));
        assert_ne!(a, staging(&d.path().join("disk.qcow2")).unwrap());
    }
}
