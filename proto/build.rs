//! Compiles `csi.proto` and the kubelet's `pluginregistration.proto` into tonic
//! servers and clients. protox parses the files in pure Rust, so building needs
//! no system `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=csi.proto");
    println!("cargo:rerun-if-changed=pluginregistration.proto");
    let fds = protox::compile(["csi.proto", "pluginregistration.proto"], ["."])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)?;
    Ok(())
}
