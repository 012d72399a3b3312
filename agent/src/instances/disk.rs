//! Disks of instances (docs/disks.md): the create-time checks of `boot` and `disk_gib`, the
//! overlay and the UEFI variable store (made by [`Manager::prepare_disk`], a step of the
//! shared boot sequence, before anything is claimed), the copy of both on fork, and the
//! image operations that must know the instances (`image.import`, and `image.delete`,
//! which refuses an image that instance records still name).
//!
//! Files, in the instance's VMM directory (removed with the instance on delete):
//! `disk.qcow2` (the qcow2 overlay on the image's disk; the image's disk is never written)
//! and `efivars.fd` (UEFI instances: their own copy of `ovmf_vars`, made once). Both are
//! written under a temporary name and renamed, so "the agent's own file exists" means "the
//! step is done". The VMM can create names in that directory: a name holding anything but
//! the agent's own file ([`crate::own_file`]: a link, a FIFO, a file of the VMM's) is never
//! used or copied — it is removed (WARN) and the file made as for a new instance.

use super::request::ImportParams;
use super::Manager;
use crate::disks::{self, DiskError, GIB};
use crate::error::{ApiError, ErrorCode};
use crate::hypervisor::{FirmwareBoot, HypervisorKind, UefiPflash};
use crate::images::{self, Image};
use crate::store::{BootMode, InstanceRecord};
use crate::wire::ImageDeleted;
use std::path::PathBuf;

/// The overlay's file name in the instance directory.
pub const OVERLAY: &str = "disk.qcow2";
/// The UEFI variable store's file name in the instance directory.
pub const EFIVARS: &str = "efivars.fd";

fn disk_error(e: DiskError) -> ApiError {
    match e {
        DiskError::Invalid(m) => ApiError::invalid_request(m),
        DiskError::Tool(m) => ApiError::internal(m),
    }
}

impl Manager {
    /// The image of an instance. Errors: `invalid_request` when it no longer exists.
    pub(crate) fn image_of(&self, rec: &InstanceRecord) -> Result<Image, ApiError> {
        images::load(&self.store.images_dir(), &rec.image).map_err(|e| {
            if e.code == ErrorCode::NotFound {
                ApiError::invalid_request(format!("image {} of instance {} no longer exists", rec.image, rec.name))
            } else {
                e
            }
        })
    }

    /// Makes the files of `image` readable by every VMM ([`images::IMAGE_FILE_MODE`]): an
    /// image imported before imports did so keeps a `0600` source's mode, and no VMM of it
    /// could start. A failure is logged; the start then fails naming the file.
    pub(crate) fn image_readable_for_vmms(&self, image: &Image) {
        use std::os::unix::fs::PermissionsExt;
        let files = [image.kernel.as_ref(), image.initrd.as_ref(), image.disk.as_ref().map(|d| &d.path)];
        for f in files.into_iter().flatten() {
            let Ok(m) = std::fs::symlink_metadata(f) else { continue };
            if m.file_type().is_file() && m.permissions().mode() & 0o004 == 0 {
                match std::fs::set_permissions(f, std::fs::Permissions::from_mode(images::IMAGE_FILE_MODE)) {
                    Ok(()) => tracing::info!(image = %image.name, file = %f.display(),
                        "image file made readable for VMMs (mode 0644)"),
                    Err(e) => tracing::warn!(image = %image.name, file = %f.display(), error = %e,
                        "an image file cannot be made readable for VMMs"),
                }
            }
        }
    }

    /// The boot mode of a new instance of `image` on `hypervisor`, checked: `direct` needs a
    /// kernel and is the default when the image has one; `bios` and `uefi` need a disk,
    /// `bios` is the default for a disk-only image; `uefi` needs the hypervisor's UEFI
    /// firmware files ([`HypervisorKind::uefi_firmware`]); `disk_gib`
    /// needs a disk and at least its virtual size; the hypervisor must boot that way
    /// ([`HypervisorKind::cannot_boot`]). Errors: `invalid_request` naming the field,
    /// `hypervisor_unsupported`.
    pub(crate) fn check_disk_request(
        &self,
        image: &Image,
        hypervisor: HypervisorKind,
        boot: Option<BootMode>,
        disk_gib: Option<u64>,
    ) -> Result<BootMode, ApiError> {
        let asked = boot;
        let boot = boot.unwrap_or(if image.kernel.is_some() { BootMode::Direct } else { BootMode::Bios });
        match (boot, &image.kernel, &image.disk) {
            (BootMode::Direct, None, _) => {
                return Err(ApiError::invalid_request(format!(
                    "boot \"direct\" needs a kernel, and image {} has only a disk (use boot \"bios\" or \"uefi\")",
                    image.name
                )))
            }
            (BootMode::Bios | BootMode::Uefi, _, None) => {
                return Err(ApiError::invalid_request(format!(
                    "boot \"{}\" boots a disk, and image {} has none (use boot \"direct\")",
                    boot.as_str(),
                    image.name
                )))
            }
            _ => {}
        }
        let firmware = match boot {
            BootMode::Direct => None,
            BootMode::Bios => Some(FirmwareBoot::Bios),
            BootMode::Uefi => Some(FirmwareBoot::Uefi),
        };
        if let Some(why) = hypervisor.cannot_boot(firmware, &self.cfg) {
            // A boot nobody asked for is the image's doing: say so.
            let what = match asked {
                Some(_) => format!("boot \"{}\" (image {})", boot.as_str(), image.name),
                None => format!(
                    "image {} has no kernel, only a disk, which boots through firmware (boot \"{}\" by default)",
                    image.name,
                    boot.as_str()
                ),
            };
            return Err(ApiError::hypervisor_unsupported(format!("{what}: {why}"), Some(hypervisor.name()), None));
        }
        match (disk_gib, &image.disk) {
            (Some(_), None) => {
                return Err(ApiError::invalid_request(format!(
                    "disk_gib sizes the disk overlay, and image {} has no disk",
                    image.name
                )))
            }
            (Some(g), Some(d)) if g.saturating_mul(GIB) < d.virtual_size_bytes => {
                return Err(ApiError::invalid_request(format!(
                    "disk_gib {g} is smaller than the disk of image {} ({} bytes, {} GiB rounded up)",
                    image.name,
                    d.virtual_size_bytes,
                    d.virtual_size_bytes.div_ceil(GIB)
                )))
            }
            _ => {}
        }
        if boot == BootMode::Uefi {
            self.uefi_firmware(hypervisor)?;
        }
        Ok(boot)
    }

    /// The UEFI firmware of `hypervisor` ([`HypervisorKind::uefi_firmware`]): its code and,
    /// when it keeps one, its variable store template, each checked to be there. Errors:
    /// `invalid_request` naming the missing file and its config key.
    fn uefi_firmware(&self, hypervisor: HypervisorKind) -> Result<(PathBuf, Option<PathBuf>), ApiError> {
        let fw = hypervisor.uefi_firmware(&self.cfg).ok_or_else(|| {
            ApiError::invalid_request(format!("boot \"uefi\" has no firmware configured for {hypervisor}"))
        })?;
        for (key, p) in std::iter::once(fw.code).chain(fw.vars) {
            if !p.is_file() {
                return Err(ApiError::invalid_request(format!(
                    "boot \"uefi\" needs the UEFI firmware {} (config key {key}), which is missing",
                    p.display()
                )));
            }
        }
        Ok((fw.code.1.to_path_buf(), fw.vars.map(|v| v.1.to_path_buf())))
    }

    /// The disk and firmware of the VM spec: the overlay when the image has a disk, the
    /// firmware for `uefi` (with the instance's variable store when the firmware keeps one).
    pub(crate) fn disk_spec(&self, rec: &InstanceRecord, image: &Image) -> (Option<PathBuf>, Option<UefiPflash>) {
        let dir = self.store.vmm_dir(rec.id);
        let disk = image.disk.as_ref().map(|_| dir.join(OVERLAY));
        let uefi = (rec.boot == BootMode::Uefi)
            .then(|| rec.hypervisor.uefi_firmware(&self.cfg))
            .flatten()
            .map(|fw| UefiPflash { code: fw.code.1.to_path_buf(), vars: fw.vars.map(|_| dir.join(EFIVARS)) });
        (disk, uefi)
    }

    /// The disk step of create and start (before anything is claimed): makes the overlay
    /// on the image's disk when it is missing (`disk_gib` sets its size) and, for `uefi`,
    /// the instance's variable store when it is missing. Errors: `invalid_request` (the
    /// image is gone, the firmware is missing), `internal` (`qemu-img` failed).
    pub(crate) fn prepare_disk(&self, rec: &InstanceRecord) -> Result<(), ApiError> {
        let image = self.image_of(rec)?;
        let dir = self.vmm_dir_ready(rec)?;
        if let Some(d) = &image.disk {
            let overlay = dir.join(OVERLAY);
            if !self.own_or_cleared(rec, &dir, OVERLAY)? {
                let size = rec.disk_gib.map(|g| g.saturating_mul(GIB));
                disks::create_overlay(&self.cfg.qemu_img_binary, &d.path, d.format, size, &overlay)
                    .map_err(disk_error)?;
                tracing::info!(instance.id = %rec.id, instance.name = %rec.name, overlay = %overlay.display(),
                    base = %d.path.display(), disk_gib = ?rec.disk_gib, "disk overlay created");
            }
        }
        if rec.boot == BootMode::Uefi {
            if let (_, Some(vars)) = self.uefi_firmware(rec.hypervisor)? {
                if !self.own_or_cleared(rec, &dir, EFIVARS)? {
                    disks::copy_file(&vars, &dir.join(EFIVARS)).map_err(disk_error)?;
                }
            }
        }
        crate::crash_point!("boot_after_disk");
        Ok(())
    }

    /// True when `dir/name` is the agent's own file; otherwise the name is free on return
    /// (whatever a VMM planted there is removed, with a WARN naming it).
    fn own_or_cleared(&self, rec: &InstanceRecord, dir: &std::path::Path, name: &str) -> Result<bool, ApiError> {
        let fail = |e: std::io::Error| ApiError::internal(format!("{}: {e}", dir.join(name).display()));
        match crate::own_file::inspect(dir, name).map_err(fail)? {
            crate::own_file::Entry::Own(_) => Ok(true),
            crate::own_file::Entry::Missing => Ok(false),
            crate::own_file::Entry::Foreign(what) => {
                tracing::warn!(instance.id = %rec.id, instance.name = %rec.name, file = %dir.join(name).display(),
                    found = %what, "not the agent's own file (a VMM may have planted it): removed, made again");
                crate::own_file::remove(dir, name).map_err(fail)?;
                Ok(false)
            }
        }
    }

    /// Fork: copies the source's overlay and variable store (those that are the agent's own
    /// files) into the fork's VMM directory, so the fork starts from the source's disk state
    /// and its own writes never reach the source. The source must not run (the caller
    /// checks) unless the copy is of its snapshot at `snapshot` (the directory); a link or any
    /// other plant in its directory is never followed.
    pub(crate) fn copy_disk_state(
        &self,
        src: &InstanceRecord,
        snapshot: Option<&std::path::Path>,
        dst: &InstanceRecord,
    ) -> Result<(), ApiError> {
        let from = match snapshot {
            Some(dir) => dir.to_path_buf(),
            None if src.state() == crate::store::InstanceState::Stopped => self.vmm_dir_ready(src)?,
            None => self.store.vmm_dir(src.id),
        };
        let mut to = None;
        for f in [OVERLAY, EFIVARS] {
            let fail = |e: std::io::Error| ApiError::internal(format!("{}: {e}", from.join(f).display()));
            let mut file = match crate::own_file::open(&from, f, false) {
                Ok(Ok(file)) => file,
                Ok(Err(crate::own_file::Entry::Missing)) => continue,
                Ok(Err(other)) => {
                    tracing::warn!(instance.id = %src.id, instance.name = %src.name, file = %from.join(f).display(),
                        found = %other.describe(), "not the agent's own file: not copied to the fork");
                    continue;
                }
                // A directory that is not there yet (an instance never started) has no disk state.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(fail(e)),
            };
            let to = match &to {
                Some(t) => t,
                None => to.insert(self.vmm_dir_ready(dst)?),
            };
            disks::copy_open(&mut file, &from.join(f), &to.join(f)).map_err(disk_error)?;
        }
        Ok(())
    }

    /// `image.import` ([`images::import`] with the configured `qemu-img`).
    pub fn import_image(&self, p: &ImportParams) -> Result<Image, ApiError> {
        let src = images::ImportSource {
            kernel: p.kernel.as_deref(),
            initrd: p.initrd.as_deref(),
            disk: p.disk.as_deref(),
            cmdline: p.cmdline.clone(),
        };
        let r = images::import(&self.store.images_dir(), &self.cfg.qemu_img_binary, &p.name, &src);
        if let Err(e) = &r {
            tracing::warn!(image = %p.name, code = %e.code.as_str(), error = %e.message, "image import failed");
        }
        r
    }

    /// `image.delete`: refused (`image_in_use`, naming them) while instance records name the
    /// image, and (`not_ready`) when some records cannot be read — one of them may. Under
    /// the allocation lock, which create and fork hold when they write a record naming an
    /// image, after checking that it exists.
    pub fn delete_image(&self, name: &str) -> Result<ImageDeleted, ApiError> {
        let r = (|| -> Result<ImageDeleted, ApiError> {
            let _a = self.alloc();
            let listing = self.store.scan_instances()?;
            let mut users: Vec<String> =
                listing.records.iter().filter(|r| r.image == name).map(|r| r.name.clone()).collect();
            if !users.is_empty() {
                users.sort();
                return Err(ApiError::image_in_use(name, &users));
            }
            if let Some(u) = listing.unreadable.first() {
                return Err(ApiError::not_ready(format!(
                    "image {name} is not deleted: the instance record {} cannot be read ({}), and it may use the image",
                    u.path.display(),
                    u.error
                )));
            }
            images::delete(&self.store.images_dir(), name)?;
            tracing::info!(image = %name, "image deleted");
            Ok(ImageDeleted { name: name.to_string(), deleted: true })
        })();
        if let Err(e) = &r {
            tracing::warn!(image = %name, code = %e.code.as_str(), error = %e.message, "image delete failed");
        }
        r
    }

    /// Create and fork, under the allocation lock before the record is written: the image
    /// still exists (an `image.delete` may have run since it was loaded). Errors:
    /// `invalid_request`.
    pub(crate) fn check_image_still_there(&self, image: &str) -> Result<(), ApiError> {
        match images::load(&self.store.images_dir(), image) {
            Ok(_) => Ok(()),
            Err(e) if e.code == ErrorCode::NotFound => {
                Err(ApiError::invalid_request(format!("image {image} was deleted while the instance was being made")))
            }
            Err(e) => Err(e),
        }
    }
}
