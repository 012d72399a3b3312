//! # images — boot artifacts under `<data-dir>/images/<name>/`
//!
//! An image is a directory holding a kernel, an optional initrd and `image.toml`
//! (`name`, `kernel`, `initrd`, `cmdline`). Instances boot only from this directory: the
//! API never takes a kernel path at create time.

use crate::error::ApiError;
use serde::{Deserialize, Serialize};
use std::fs;
use std::path::{Path, PathBuf};

/// `image.toml`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImageManifest {
    pub name: String,
    /// File name of the kernel inside the image directory.
    pub kernel: String,
    /// File name of the initrd inside the image directory.
    pub initrd: Option<String>,
    /// Kernel command line; the agent's `default_cmdline` when absent.
    pub cmdline: Option<String>,
}

/// A resolved image.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Image {
    pub name: String,
    pub kernel: PathBuf,
    pub initrd: Option<PathBuf>,
    pub cmdline: Option<String>,
    /// Total size of the artifacts, bytes.
    pub size_bytes: u64,
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
    let kernel = dir.join(&m.kernel);
    let initrd = m.initrd.as_ref().map(|i| dir.join(i));
    let size_bytes = [Some(&kernel), initrd.as_ref()]
        .into_iter()
        .flatten()
        .map(|p| fs::metadata(p).map(|m| m.len()).unwrap_or(0))
        .sum();
    Ok(Image { name: m.name, kernel, initrd, cmdline: m.cmdline, size_bytes })
}

/// Every image, sorted by name (broken ones are skipped with a warning).
pub fn list(images_dir: &Path) -> Vec<Image> {
    let mut out = Vec::new();
    if let Ok(rd) = fs::read_dir(images_dir) {
        for e in rd.filter_map(|e| e.ok()) {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') {
                continue;
            }
            match load(images_dir, &name) {
                Ok(i) => out.push(i),
                Err(err) => tracing::warn!(image = %name, error = %err, "skipping broken image"),
            }
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// Copies a kernel (and initrd) into `images_dir/<name>/` and writes `image.toml`
/// atomically (staged in a hidden directory, then renamed). Errors: `invalid_request` for a
/// bad name or an unreadable source file, `name_taken` if the image exists.
pub fn import(
    images_dir: &Path,
    name: &str,
    kernel: &Path,
    initrd: Option<&Path>,
    cmdline: Option<String>,
) -> Result<Image, ApiError> {
    if !valid_name(name) {
        return Err(ApiError::invalid_request(format!(
            "image name {name:?} is not valid (use [a-z0-9][a-z0-9._-]{{0,62}})"
        )));
    }
    // Relative paths would resolve against the agent's working directory, not the caller's.
    for (what, path) in [("kernel", Some(kernel)), ("initrd", initrd)] {
        if let Some(p) = path.filter(|p| !p.is_absolute()) {
            return Err(ApiError::invalid_request(format!("{what} path {} must be absolute", p.display())));
        }
    }
    let dir = images_dir.join(name);
    if dir.exists() {
        return Err(ApiError::name_taken("an image", name));
    }
    let stage = images_dir.join(format!(".{name}.{}", uuid::Uuid::new_v4().simple()));
    let res = (|| -> Result<(), ApiError> {
        fs::create_dir_all(&stage).map_err(ApiError::internal)?;
        fs::copy(kernel, stage.join("vmlinuz"))
            .map_err(|e| ApiError::invalid_request(format!("cannot read kernel {}: {e}", kernel.display())))?;
        if let Some(i) = initrd {
            fs::copy(i, stage.join("initrd.img"))
                .map_err(|e| ApiError::invalid_request(format!("cannot read initrd {}: {e}", i.display())))?;
        }
        let m = ImageManifest {
            name: name.to_string(),
            kernel: "vmlinuz".into(),
            initrd: initrd.map(|_| "initrd.img".into()),
            cmdline,
        };
        let text = toml::to_string(&m).map_err(ApiError::internal)?;
        fs::write(stage.join("image.toml"), text).map_err(ApiError::internal)?;
        fs::rename(&stage, &dir).map_err(ApiError::internal)?;
        Ok(())
    })();
    if let Err(e) = res {
        let _ = fs::remove_dir_all(&stage);
        return Err(e);
    }
    load(images_dir, name)
}

/// Deletes an image directory. Errors: `not_found`.
pub fn delete(images_dir: &Path, name: &str) -> Result<(), ApiError> {
    load(images_dir, name)?;
    fs::remove_dir_all(images_dir.join(name)).map_err(ApiError::internal)
}
