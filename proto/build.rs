//! Compiles `csi.proto`, the kubelet's `pluginregistration.proto` and the
//! driver's `mesh.proto` into tonic
//! servers and clients. protox parses the files in pure Rust, so building needs
//! no system `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=csi.proto");
    println!("cargo:rerun-if-changed=pluginregistration.proto");
    println!("cargo:rerun-if-changed=mesh.proto");
    let fds = protox::compile(
        ["csi.proto", "pluginregistration.proto", "mesh.proto"],
        ["."],
    )?;
    // Every CSI method by its service, for code that names calls (metrics
    // labels, the fuzzer) without a list of its own to keep up to date.
    let mut rpcs = String::from(
        "/// Every method of the CSI services as (service, method), in the order of\n\
         /// `csi.proto`.\n\
         pub const RPCS: &[(&str, &str)] = &[\n",
    );
    for file in fds.file.iter().filter(|f| f.package() == "csi.v1") {
        for service in &file.service {
            for method in &service.method {
                rpcs += &format!("    ({:?}, {:?}),\n", service.name(), method.name());
            }
        }
    }
    rpcs += "];\n";
    let out_dir = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out_dir.join("csi_rpcs.rs"), rpcs)?;
    // Maps (volume context, parameters, topology segments, secrets) as
    // `BTreeMap`: they hold a few entries, which a B-tree keeps in one node
    // without hashing each key, and they print and compare in a stable order.
    tonic_prost_build::configure()
        .btree_map(".")
        // A piece of a volume's data (1 MiB) decodes as a view of the
        // received message, not a copy of it.
        .bytes(".example.csi.mesh.v1.Chunk.data")
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)?;
    Ok(())
}
