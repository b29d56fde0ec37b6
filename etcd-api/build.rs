//! Generates the etcd v3 KV and Lease clients from our own proto, with the
//! `protoc` that protoc-bin-vendored ships (no system protoc needed).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut config = prost_build::Config::new();
    config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(false)
        .compile_with_config(config, &["proto/etcd_v3.proto"], &["proto"])?;
    println!("cargo:rerun-if-changed=proto/etcd_v3.proto");
    Ok(())
}
