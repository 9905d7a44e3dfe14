//! Lists the tensors and blocks of a model: `cargo run -p st-mmap --example
//! inspect -- MODEL_DIR_OR_FILE [BLOCK_PREFIX]`.

use st_mmap::{BlockIndex, BlockPrefix, SafetensorsSet};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .ok_or("usage: inspect MODEL_DIR_OR_FILE [BLOCK_PREFIX]")?;
    let prefix = BlockPrefix::new(args.next().unwrap_or_else(|| "model.layers.".into()));
    let set = if std::path::Path::new(&path).is_dir() {
        SafetensorsSet::open_dir(&path)?
    } else {
        SafetensorsSet::open_files([&path])?
    };
    let mut bytes = 0;
    for key in set.keys() {
        let t = set.tensor(key).expect("listed keys exist");
        bytes += t.data.len();
        println!("{key}: {} {:?}", t.dtype, t.shape);
    }
    let blocks = BlockIndex::build(&prefix, set.keys())?;
    println!(
        "{} tensors, {bytes} bytes, {} blocks under {:?}",
        set.len(),
        blocks.len(),
        prefix.as_str()
    );
    Ok(())
}
