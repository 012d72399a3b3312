//! Writes the pool's ResourceSlices to the API server: every rewrite moves the pool's
//! generation, each slice is server-side applied (field manager `gpuvisor-dra`), slices the
//! new pool no longer needs are deleted, and [`Publisher::delete_all`] removes them when the
//! component stops for good.

use crate::model::{self, Pool, DRIVER};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::ResourceSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use std::collections::BTreeSet;

/// The label that marks this node component's slices.
pub const NODE_LABEL: &str = "gpu.gpuvisor.example/node";
const MANAGER: &str = "gpuvisor-dra";

/// The node's published pool.
pub struct Publisher {
    api: Api<ResourceSlice>,
    nodes: Api<Node>,
    node: String,
    generation: i64,
    last: Option<Pool>,
    names: BTreeSet<String>,
}

impl Publisher {
    /// Reads what an earlier run published (the generation continues from it).
    pub async fn new(client: kube::Client, node: &str) -> Result<Publisher, kube::Error> {
        let api: Api<ResourceSlice> = Api::all(client.clone());
        let mut p = Publisher {
            api,
            nodes: Api::all(client),
            node: node.into(),
            generation: 0,
            last: None,
            names: BTreeSet::new(),
        };
        for s in p.list().await? {
            p.generation = p.generation.max(s.spec.pool.generation);
            p.names.extend(s.metadata.name);
        }
        Ok(p)
    }

    async fn list(&self) -> Result<Vec<ResourceSlice>, kube::Error> {
        let lp = ListParams::default().labels(&format!("{NODE_LABEL}={}", self.node));
        Ok(self.api.list(&lp).await?.items.into_iter().filter(|s| s.spec.driver == DRIVER).collect())
    }

    /// The pool's current generation.
    pub fn generation(&self) -> i64 {
        self.generation
    }

    /// Publishes `pool` if it differs from what was last published; answers whether it wrote.
    pub async fn publish(&mut self, pool: &Pool) -> Result<bool, kube::Error> {
        if self.last.as_ref() == Some(pool) {
            return Ok(false);
        }
        let owner = match self.nodes.get_opt(&self.node).await? {
            Some(n) => n.metadata.uid.map(|uid| OwnerReference {
                api_version: "v1".into(),
                kind: "Node".into(),
                name: self.node.clone(),
                uid,
                controller: Some(true),
                block_owner_deletion: None,
            }),
            None => None,
        };
        let generation = self.generation + 1;
        let specs = model::slices(pool, &self.node, generation);
        let mut names = BTreeSet::new();
        for (name, spec) in specs {
            let slice = ResourceSlice {
                metadata: ObjectMeta {
                    name: Some(name.clone()),
                    labels: Some([(NODE_LABEL.to_string(), self.node.clone())].into()),
                    owner_references: owner.clone().map(|o| vec![o]),
                    ..Default::default()
                },
                spec,
            };
            let mut v = serde_json::to_value(&slice).map_err(kube::Error::SerdeError)?;
            v["apiVersion"] = "resource.k8s.io/v1".into();
            v["kind"] = "ResourceSlice".into();
            self.api.patch(&name, &PatchParams::apply(MANAGER).force(), &Patch::Apply(v)).await?;
            names.insert(name);
        }
        self.generation = generation;
        for old in self.names.difference(&names) {
            match self.api.delete(old, &DeleteParams::default()).await {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => return Err(e),
            }
        }
        self.names = names;
        self.last = Some(pool.clone());
        Ok(true)
    }

    /// Deletes every slice of this node's pool (the component stops for good).
    pub async fn delete_all(&mut self) -> Result<(), kube::Error> {
        for s in self.list().await? {
            if let Some(name) = s.metadata.name {
                match self.api.delete(&name, &DeleteParams::default()).await {
                    Ok(_) => {}
                    Err(kube::Error::Api(e)) if e.code == 404 => {}
                    Err(e) => return Err(e),
                }
            }
        }
        self.names.clear();
        self.last = None;
        Ok(())
    }
}
