//! The kubelet's gRPC services, generated from `proto/` by build.rs.
#![allow(missing_docs, clippy::all)]

/// `k8s.io.kubelet.pkg.apis.dra.v1`
pub mod dra_v1 {
    tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");
}
/// `k8s.io.kubelet.pkg.apis.dra.v1beta1`
pub mod dra_v1beta1 {
    tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1beta1");
}
/// `v1` (DRA resource health)
pub mod health_v1 {
    tonic::include_proto!("v1");
}
/// `pluginregistration`
pub mod registration {
    tonic::include_proto!("pluginregistration");
}
