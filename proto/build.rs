//! Generates the pd.v1 messages and services into OUT_DIR (never committed), with the
//! vendored protoc so a fresh machine needs nothing installed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    let include = protoc_bin_vendored::include_path()?;
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    // SAFETY: build scripts are single-threaded; the variable is read by the code generator.
    unsafe { std::env::set_var("PROTOC", protoc) };
    let files = [
        "pd/v1/common.proto",
        "pd/v1/generation.proto",
        "pd/v1/node.proto",
    ];
    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("pd_v1_descriptor.bin"))
        .compile_protos(
            &files,
            &[".", include.to_str().ok_or("non-UTF-8 include path")?],
        )?;
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
    Ok(())
}
