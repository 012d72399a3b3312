//! # images — boot artifacts under `<data-dir>/images/<name>/`
//!
//! An image is a directory holding a kernel and an optional initrd (direct boot), a disk
//! (`disk.qcow2` or `disk.raw`, booted through the firmware or carried next to a direct
//! boot), or both, and `image.toml` (`name`, `kernel`, `initrd`, `cmdline`, `disk`,
//! `disk_format`, `disk_virtual_size_bytes`; manifests written before disks existed still
//! load). Instances boot only from this directory: the API never takes a kernel or disk
//! path at create time. Instances never write to an image's disk: each has its own qcow2
//! overlay on it ([`crate::disks`]).

use crate::disks::{self, DiskFormat};
use crate::error::ApiError;
use serde::{Deserialize, Serialize};
use std::fs;
use std::path::{Path, PathBuf};

/// `image.toml`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImageManifest {
    /// The image's name (`[a-z0-9][a-z0-9._-]{0,62}`), as written at import.
    pub name: String,
    /// File name of the kernel inside the image directory; absent for a disk-only image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel: Option<String>,
    /// File name of the initrd inside the image directory.
    pub initrd: Option<String>,
    /// Kernel command line; the agent's `default_cmdline` when absent.
    pub cmdline: Option<String>,
    /// File name of the disk inside the image directory (`disk.qcow2`, `disk.raw`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk: Option<String>,
    /// The disk's format; with `disk`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_format: Option<DiskFormat>,
    /// The size the guest sees, bytes (`qemu-img info`'s `virtual-size`); with `disk`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_virtual_size_bytes: Option<u64>,
}

/// The disk of an image.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct ImageDisk {
    /// The disk file in the image directory.
    pub path: PathBuf,
    /// `qcow2` or `raw`.
    pub format: DiskFormat,
    /// The size the guest sees, bytes; an instance's overlay is at least this large.
    pub virtual_size_bytes: u64,
}

/// A resolved image.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Image {
    /// The image's name (`[a-z0-9][a-z0-9._-]{0,62}`).
    pub name: String,
    /// The direct-boot kernel; `None` for a disk-only image.
    pub kernel: Option<PathBuf>,
    /// The initrd booted with the kernel; `None` when the image has none.
    pub initrd: Option<PathBuf>,
    /// The kernel command line of a direct boot; `None`: the agent's `default_cmdline`.
    pub cmdline: Option<String>,
    /// Total size of the artifacts, bytes (files as stored).
    pub size_bytes: u64,
    /// The image's disk, if it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk: Option<ImageDisk>,
}

/// Image names: `[a-z0-9][a-z0-9._-]{0,62}`.
pub fn valid_name(name: &str) -> bool {
    let b = name.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && (b[0].is_ascii_lowercase() || b[0].is_ascii_digit())
        && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, b'-' | b'_' | b'.'))
}

/// Reads image `name` from `images_dir`. Errors: `not_found`, or `invalid_request` for a
/// broken manifest.
pub fn load(images_dir: &Path, name: &str) -> Result<Image, ApiError> {
    if !valid_name(name) {
        return Err(ApiError::invalid_request(format!("image name {name:?} is not valid")));
    }
    let dir = images_dir.join(name);
    let text = match fs::read_to_string(dir.join("image.toml")) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(ApiError::not_found(&format!("image {name}")))
        }
        Err(e) => return Err(ApiError::internal(format!("cannot read image {name}: {e}"))),
    };
    let m: ImageManifest =
        toml::from_str(&text).map_err(|e| ApiError::internal(format!("image {name} has a broken image.toml: {e}")))?;
    let kernel = m.kernel.as_ref().map(|k| dir.join(k));
    let initrd = m.initrd.as_ref().map(|i| dir.join(i));
    let disk = match (&m.disk, m.disk_format, m.disk_virtual_size_bytes) {
        (None, _, _) => None,
        (Some(d), Some(format), Some(virtual_size_bytes)) => {
            Some(ImageDisk { path: dir.join(d), format, virtual_size_bytes })
        }
        (Some(_), _, _) => {
            return Err(ApiError::internal(format!(
                "image {name} has a broken image.toml: disk needs disk_format and disk_virtual_size_bytes"
            )))
        }
    };
    if kernel.is_none() && disk.is_none() {
        return Err(ApiError::internal(format!("image {name} has a broken image.toml: neither a kernel nor a disk")));
    }
    let size_bytes = [kernel.as_ref(), initrd.as_ref(), disk.as_ref().map(|d| &d.path)]
        .into_iter()
        .flatten()
        .map(|p| fs::metadata(p).map(|m| m.len()).unwrap_or(0))
        .sum();
    Ok(Image { name: m.name, kernel, initrd, cmdline: m.cmdline, size_bytes, disk })
}

/// An image directory whose manifest or files cannot be read (listed, never hidden).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct UnreadableImage {
    /// The directory's name.
    pub name: String,
    /// Why it cannot be used (one sentence).
    pub error: String,
}

/// Every image, sorted by name, and every image directory that cannot be read (its
/// `image.toml` missing, unreadable or broken), each named with the reason: a view never
/// hides what it cannot read. Errors: the images directory cannot be listed.
pub fn list(images_dir: &Path) -> Result<(Vec<Image>, Vec<UnreadableImage>), ApiError> {
    let mut out = Vec::new();
    let mut unreadable = Vec::new();
    let rd = match fs::read_dir(images_dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((out, unreadable)),
        Err(e) => return Err(ApiError::internal(format!("cannot list {}: {e}", images_dir.display()))),
    };
    for e in rd {
        let e = e.map_err(|e| ApiError::internal(format!("cannot list {}: {e}", images_dir.display())))?;
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') {
            continue;
        }
        match load(images_dir, &name) {
            Ok(i) => out.push(i),
            Err(err) => {
                let error = if err.code == crate::error::ErrorCode::NotFound {
                    format!("{} has no image.toml", images_dir.join(&name).display())
                } else {
                    err.message
                };
                unreadable.push(UnreadableImage { name, error })
            }
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    unreadable.sort_by(|a, b| a.name.cmp(&b.name));
    Ok((out, unreadable))
}

/// Copies the caller's `src` (the `what` of an import) to `dest` in the images
/// directory. A source that cannot be opened or read is the caller's problem
/// (`invalid_request`, "cannot read …"); a destination that cannot be written is the
/// host's (`internal`): ENOSPC or EDQUOT says the images directory is full.
fn copy_in(what: &str, src: &Path, dest: &Path) -> Result<(), ApiError> {
    use std::io::{Read, Write};
    let read_err = |e: std::io::Error| ApiError::invalid_request(format!("cannot read {what} {}: {e}", src.display()));
    let mut from = fs::File::open(src).map_err(read_err)?;
    let mut to =
        fs::OpenOptions::new().write(true).create_new(true).open(dest).map_err(|e| write_error(what, dest, e))?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(read_err(e)),
        };
        to.write_all(&buf[..n]).map_err(|e| write_error(what, dest, e))?;
    }
    to.sync_all().map_err(|e| write_error(what, dest, e))
}

/// The error of a write into the images directory: a full filesystem (ENOSPC, EDQUOT) is
/// said as such, naming the directory.
fn write_error(what: &str, dest: &Path, e: std::io::Error) -> ApiError {
    let dir = dest.parent().and_then(Path::parent).unwrap_or(dest);
    match e.raw_os_error() {
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => ApiError::internal(format!(
            "the images directory {} is full ({}) while writing the {what}: free space there and import again; \
             nothing was imported",
            dir.display(),
            crate::devices::errno_name(&e)
        )),
        _ => ApiError::internal(format!("cannot write the {what} into {}: {e}", dir.display())),
    }
}

/// What `image.import` copies in: a kernel (with an initrd) for direct boot, a disk, or
/// both. Paths are absolute, on the agent's host.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ImportSource<'a> {
    /// The kernel to copy in (direct boot).
    pub kernel: Option<&'a Path>,
    /// The initrd to copy in with the kernel.
    pub initrd: Option<&'a Path>,
    /// The disk to copy in.
    pub disk: Option<&'a Path>,
    /// The kernel command line to record for a direct boot.
    pub cmdline: Option<String>,
}

/// The mode of an image's files: every VMM reads them (through its read-only view), none
/// writes them — whatever the source's mode was (a kernel from `/boot` is often `0600`).
pub const IMAGE_FILE_MODE: u32 = 0o644;

/// Why `head` (a file's first bytes) is not a kernel QEMU or Cloud Hypervisor boots
/// directly, or `None`: an x86 bzImage has `HdrS` at 0x202 (the boot protocol's header,
/// the kernel's `Documentation/arch/x86/boot.rst`), a vmlinux or PVH kernel is an ELF file.
pub fn not_a_kernel(head: &[u8]) -> Option<String> {
    if head.get(0x202..0x206) == Some(b"HdrS") || head.starts_with(b"\x7fELF") {
        return None;
    }
    Some("is neither an x86 bzImage (no \"HdrS\" at offset 0x202) nor an ELF kernel".into())
}

/// Why `head` is not an initrd the kernel unpacks, or `None`: a cpio archive (`070701`,
/// `070702`, `070707`, or binary cpio) or a compressed stream the kernel knows (gzip, xz,
/// zstd, bzip2, lzma, lz4, lzop; `usr/Kconfig`'s `RD_*`).
pub fn not_an_initrd(head: &[u8]) -> Option<String> {
    const MAGIC: &[&[u8]] = &[
        b"070701",
        b"070702",
        b"070707",
        &[0xc7, 0x71],
        &[0x71, 0xc7],
        &[0x1f, 0x8b],
        &[0x1f, 0x9e],
        &[0xfd, b'7', b'z', b'X', b'Z', 0x00],
        &[0x28, 0xb5, 0x2f, 0xfd],
        b"BZh",
        &[0x5d, 0x00, 0x00],
        &[0x02, 0x21, 0x4c, 0x18],
        &[0x04, 0x22, 0x4d, 0x18],
        &[0x89, b'L', b'Z', b'O'],
    ];
    if MAGIC.iter().any(|m| head.starts_with(m)) {
        return None;
    }
    Some(
        "is neither a cpio archive nor a compressed stream the kernel unpacks (gzip, xz, zstd, bzip2, lzma, lz4, lzop)"
            .into(),
    )
}

/// The first 1 KiB of `path` (less for a shorter file).
fn head_of(path: &Path) -> std::io::Result<Vec<u8>> {
    let mut f = fs::File::open(path)?;
    let mut buf = Vec::with_capacity(1024);
    std::io::Read::read_to_end(&mut std::io::Read::take(&mut f, 1024), &mut buf)?;
    Ok(buf)
}

/// Copies a kernel (and initrd) and/or a disk into `images_dir/<name>/` and writes
/// `image.toml` atomically (staged in a hidden directory, then renamed; a staging
/// directory a kill left is removed when the agent starts). The kernel must be a bzImage or
/// an ELF kernel ([`not_a_kernel`]), the initrd a cpio archive or a compressed stream
/// ([`not_an_initrd`]). The disk is inspected and copied with `qemu_img`
/// ([`disks::inspect`], [`disks::copy_into_image`]: `disk.qcow2` or `disk.raw`, flattened).
/// Every copied file gets [`IMAGE_FILE_MODE`] (VMMs read them). Errors: `invalid_request`
/// for a bad name, a relative path, neither a kernel nor a disk, an initrd without a
/// kernel, an unreadable source file, a kernel or initrd that is not one, or a disk that is
/// not a qcow2 or a partitioned raw disk or whose backing file is missing; `name_taken` if
/// the image exists; `internal` when `qemu-img` cannot run or the images directory cannot
/// be written (full: says so).
pub fn import(images_dir: &Path, qemu_img: &Path, name: &str, src: &ImportSource<'_>) -> Result<Image, ApiError> {
    if !valid_name(name) {
        return Err(ApiError::invalid_request(format!(
            "image name {name:?} is not valid (use [a-z0-9][a-z0-9._-]{{0,62}})"
        )));
    }
    // Relative paths would resolve against the agent's working directory, not the caller's.
    for (what, path) in [("kernel", src.kernel), ("initrd", src.initrd), ("disk", src.disk)] {
        if let Some(p) = path.filter(|p| !p.is_absolute()) {
            return Err(ApiError::invalid_request(format!("{what} path {} must be absolute", p.display())));
        }
    }
    if src.kernel.is_none() && src.disk.is_none() {
        return Err(ApiError::invalid_request("an image needs a kernel, a disk, or both"));
    }
    if src.kernel.is_none() && src.initrd.is_some() {
        return Err(ApiError::invalid_request("initrd is only used with a kernel (direct boot)"));
    }
    let dir = images_dir.join(name);
    if dir.exists() {
        return Err(ApiError::name_taken("an image", name));
    }
    for (what, path, check) in
        [("kernel", src.kernel, not_a_kernel as fn(&[u8]) -> Option<String>), ("initrd", src.initrd, not_an_initrd)]
    {
        if let Some(p) = path {
            let head = head_of(p)
                .map_err(|e| ApiError::invalid_request(format!("cannot read {what} {}: {e}", p.display())))?;
            if let Some(why) = check(&head) {
                return Err(ApiError::invalid_request(format!("{what} {} {why}", p.display())));
            }
        }
    }
    let disk_err = |e: disks::DiskError| match e {
        disks::DiskError::Invalid(m) => ApiError::invalid_request(m),
        disks::DiskError::Tool(m) => ApiError::internal(m),
    };
    let disk = src.disk.map(|d| disks::inspect(qemu_img, d).map(|info| (d, info))).transpose().map_err(disk_err)?;
    let stage = images_dir.join(format!(".{name}.{}", uuid::Uuid::new_v4().simple()));
    let res = (|| -> Result<(), ApiError> {
        fs::create_dir_all(&stage).map_err(|e| write_error("staging directory", &stage.join("."), e))?;
        if let Some(k) = src.kernel {
            copy_in("kernel", k, &stage.join("vmlinuz"))?;
        }
        if let Some(i) = src.initrd {
            copy_in("initrd", i, &stage.join("initrd.img"))?;
        }
        crate::crash_point!("import_after_stage");
        let disk_file = disk.as_ref().map(|(_, info)| format!("disk.{}", info.format));
        if let (Some((d, info)), Some(f)) = (&disk, &disk_file) {
            disks::copy_into_image(qemu_img, d, info, &stage.join(f)).map_err(disk_err)?;
        }
        let m = ImageManifest {
            name: name.to_string(),
            kernel: src.kernel.map(|_| "vmlinuz".into()),
            initrd: src.initrd.map(|_| "initrd.img".into()),
            cmdline: src.cmdline.clone(),
            disk: disk_file,
            disk_format: disk.as_ref().map(|(_, i)| i.format),
            disk_virtual_size_bytes: disk.as_ref().map(|(_, i)| i.virtual_size_bytes),
        };
        for f in [m.kernel.as_ref(), m.initrd.as_ref(), m.disk.as_ref()].into_iter().flatten() {
            use std::os::unix::fs::PermissionsExt;
            fs::set_permissions(stage.join(f), fs::Permissions::from_mode(IMAGE_FILE_MODE))
                .map_err(ApiError::internal)?;
        }
        let text = toml::to_string(&m).map_err(ApiError::internal)?;
        fs::write(stage.join("image.toml"), text).map_err(|e| write_error("manifest", &stage.join("image.toml"), e))?;
        fs::rename(&stage, &dir).map_err(ApiError::internal)?;
        Ok(())
    })();
    if let Err(e) = res {
        let _ = fs::remove_dir_all(&stage);
        return Err(e);
    }
    load(images_dir, name)
}

/// Deletes an image directory. Errors: `not_found`. The caller refuses an image that
/// instances still use (`Manager::delete_image`).
pub fn delete(images_dir: &Path, name: &str) -> Result<(), ApiError> {
    load(images_dir, name)?;
    fs::remove_dir_all(images_dir.join(name)).map_err(ApiError::internal)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manifest_written_before_disks_existed_still_loads() {
        let d = tempfile::tempdir().unwrap();
        fs::create_dir_all(d.path().join("old")).unwrap();
        fs::write(d.path().join("old/vmlinuz"), b"k").unwrap();
        fs::write(
            d.path().join("old/image.toml"),
            "name = \"old\"\nkernel = \"vmlinuz\"\ninitrd = \"initrd.img\"\ncmdline = \"console=ttyS0\"\n",
        )
        .unwrap();
        let i = load(d.path(), "old").unwrap();
        assert_eq!(i.kernel, Some(d.path().join("old/vmlinuz")));
        assert_eq!(i.disk, None);
    }

    #[test]
    fn a_disk_only_manifest_loads_with_its_disk() {
        let d = tempfile::tempdir().unwrap();
        fs::create_dir_all(d.path().join("dsk")).unwrap();
        fs::write(
            d.path().join("dsk/image.toml"),
            "name = \"dsk\"\ndisk = \"disk.qcow2\"\ndisk_format = \"qcow2\"\ndisk_virtual_size_bytes = 1048576\n",
        )
        .unwrap();
        let i = load(d.path(), "dsk").unwrap();
        assert_eq!(i.kernel, None);
        let disk = i.disk.unwrap();
        assert_eq!((disk.format, disk.virtual_size_bytes), (DiskFormat::Qcow2, 1_048_576));
    }

    fn demo(file: &str) -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/images/demo").join(file)
    }

    /// Finding 9: a kernel and initrd from `0600` sources import `0644` (every VMM reads
    /// them, none runs as root).
    #[test]
    fn an_import_from_0600_sources_is_readable_by_every_vmm() {
        use std::os::unix::fs::PermissionsExt;
        if !demo("vmlinuz").is_file() {
            eprintln!("skipped: no demo image (scripts/build-image target/images/demo)");
            return;
        }
        let src = tempfile::tempdir().unwrap();
        for f in ["vmlinuz", "initrd.img"] {
            fs::copy(demo(f), src.path().join(f)).unwrap();
            fs::set_permissions(src.path().join(f), fs::Permissions::from_mode(0o600)).unwrap();
        }
        let d = tempfile::tempdir().unwrap();
        let (k, i) = (src.path().join("vmlinuz"), src.path().join("initrd.img"));
        let img = import(
            d.path(),
            Path::new("qemu-img"),
            "boot",
            &ImportSource { kernel: Some(&k), initrd: Some(&i), ..Default::default() },
        )
        .unwrap();
        for f in [img.kernel.unwrap(), img.initrd.unwrap()] {
            assert_eq!(fs::metadata(&f).unwrap().permissions().mode() & 0o777, IMAGE_FILE_MODE, "{}", f.display());
        }
    }

    /// Finding 9: a kernel or initrd that is not one is refused at import, naming it.
    #[test]
    fn a_file_that_is_no_kernel_or_no_initrd_is_refused() {
        let src = tempfile::tempdir().unwrap();
        let junk = src.path().join("junk");
        fs::write(&junk, b"#!/bin/sh\necho not a kernel\n").unwrap();
        let mut bz = vec![0u8; 0x300];
        bz[0x202..0x206].copy_from_slice(b"HdrS");
        let kernel = src.path().join("bz");
        fs::write(&kernel, &bz).unwrap();
        let d = tempfile::tempdir().unwrap();
        let q = Path::new("qemu-img");

        let e = import(d.path(), q, "a", &ImportSource { kernel: Some(&junk), ..Default::default() }).unwrap_err();
        assert_eq!(e.code, crate::error::ErrorCode::InvalidRequest);
        assert!(e.message.contains("kernel") && e.message.contains("neither an x86 bzImage"), "{}", e.message);
        let e = import(
            d.path(),
            q,
            "b",
            &ImportSource { kernel: Some(&kernel), initrd: Some(&junk), ..Default::default() },
        )
        .unwrap_err();
        assert!(e.message.contains("initrd") && e.message.contains("neither a cpio archive"), "{}", e.message);
        assert!(fs::read_dir(d.path()).unwrap().next().is_none(), "nothing was staged");

        assert_eq!(not_a_kernel(b"\x7fELF\x02\x01"), None);
        for head in [&b"070701000"[..], &[0x1f, 0x8b, 8][..], &[0x28, 0xb5, 0x2f, 0xfd][..], &b"BZh91AY"[..]] {
            assert_eq!(not_an_initrd(head), None, "{head:?}");
        }
    }

    #[test]
    fn an_import_without_kernel_or_disk_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let e = import(d.path(), Path::new("qemu-img"), "x", &ImportSource::default()).unwrap_err();
        assert_eq!(e.code, crate::error::ErrorCode::InvalidRequest);
        assert!(e.message.contains("kernel, a disk"), "{}", e.message);
    }
}
