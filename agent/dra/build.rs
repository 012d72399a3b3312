//! Compiles gpuvisor's declarations of the kubelet's gRPC services (proto/): the DRA service
//! twice (packages `k8s.io.kubelet.pkg.apis.dra.v1` and `…v1beta1`, from one file), resource
//! health (`v1`) and plugin registration (`pluginregistration`). protoc comes from Debian's
//! `protobuf-compiler` (scripts/setup).
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = PathBuf::from(std::env::var("OUT_DIR")?).join("proto");
    std::fs::create_dir_all(&out)?;
    let dra = std::fs::read_to_string("proto/dra.proto")?;
    let mut files = Vec::new();
    for v in ["v1", "v1beta1"] {
        let f = out.join(format!("dra_{v}.proto"));
        std::fs::write(&f, dra.replace("package PACKAGE;", &format!("package k8s.io.kubelet.pkg.apis.dra.{v};")))?;
        files.push(f);
    }
    files.push(PathBuf::from("proto/health.proto"));
    files.push(PathBuf::from("proto/registration.proto"));
    tonic_prost_build::configure().compile_protos(&files, &[PathBuf::from("proto"), out])?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}
