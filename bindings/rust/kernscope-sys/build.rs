// Finds libkernscope.so for the linker.
//   KERNSCOPE_LIB_DIR      directory holding libkernscope.so (default: <repo>/build if it has one,
//                          else the system's search path)
//   KERNSCOPE_INCLUDE_DIR  directory holding kernscope/kernscope.h (default: <repo>/include);
//                          used only to warn when the header declares a ks_* function that
//                          src/lib.rs does not (scripts/check_abi_symbols.sh makes that an error).
// The directory is handed to dependents as DEP_KERNSCOPE_LIB_DIR (the safe crate adds an rpath
// to its tests with it).
use std::env;
use std::fs;
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-env-changed=KERNSCOPE_LIB_DIR");
    println!("cargo:rerun-if-env-changed=KERNSCOPE_INCLUDE_DIR");
    println!("cargo:rerun-if-changed=src/lib.rs");
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let repo = manifest.join("../../..");

    let lib_dir = match env::var_os("KERNSCOPE_LIB_DIR") {
        Some(d) => Some(PathBuf::from(d)),
        None => {
            let d = repo.join("build");
            if d.join("libkernscope.so").exists() {
                Some(d)
            } else {
                None
            }
        }
    };
    if let Some(dir) = &lib_dir {
        if !dir.join("libkernscope.so").exists() {
            println!("cargo:warning=KERNSCOPE_LIB_DIR={} holds no libkernscope.so", dir.display());
        }
        println!("cargo:rustc-link-search=native={}", dir.display());
        println!("cargo:lib_dir={}", dir.display());
        // This crate's own test binary finds the library without LD_LIBRARY_PATH.
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.display());
    } else {
        println!(
            "cargo:warning=KERNSCOPE_LIB_DIR is not set and {} holds no libkernscope.so: linking against the \
             system's search path (set KERNSCOPE_LIB_DIR to the library's build folder, an absolute path)",
            repo.join("build").display()
        );
    }
    println!("cargo:rustc-link-lib=dylib=kernscope");

    let include = env::var_os("KERNSCOPE_INCLUDE_DIR").map(PathBuf::from).unwrap_or_else(|| repo.join("include"));
    let header = include.join("kernscope/kernscope.h");
    println!("cargo:include={}", include.display());
    if let (Ok(h), Ok(src)) = (fs::read_to_string(&header), fs::read_to_string(manifest.join("src/lib.rs"))) {
        println!("cargo:rerun-if-changed={}", header.display());
        for name in declared_functions(&h) {
            if !src.contains(&format!("fn {}(", name)) {
                println!(
                    "cargo:warning=kernscope-sys: {} (declared in {}) has no extern declaration",
                    name,
                    header.display()
                );
            }
        }
    }
}

/// Names `ks_xxx` of every `KS_API <type> ks_xxx(` declaration in the header text.
fn declared_functions(header: &str) -> Vec<String> {
    let flat = header.split_whitespace().collect::<Vec<_>>().join(" ");
    let mut out = Vec::new();
    for piece in flat.split("KS_API ").skip(1) {
        let head = match piece.find(['(', ';']) {
            Some(i) if piece.as_bytes()[i] == b'(' => &piece[..i],
            _ => continue,
        };
        if let Some(name) = head.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).rfind(|s| !s.is_empty()) {
            if name.starts_with("ks_") {
                out.push(name.to_string());
            }
        }
    }
    out
}
