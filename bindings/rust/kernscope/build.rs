// Test, example and bench binaries of this crate get an rpath to the directory kernscope-sys
// linked against (KERNSCOPE_LIB_DIR), so `cargo test` runs without LD_LIBRARY_PATH.
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_KERNSCOPE_LIB_DIR");
    if let Ok(dir) = std::env::var("DEP_KERNSCOPE_LIB_DIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir);
    }
}
