//! Prints the OpenBLAS kernels this process runs (`none` without OpenBLAS)
//! and the product of a 64×64 f32 matrix with itself, summed: a process of
//! its own, because OpenBLAS chooses its kernels once, when it loads.

fn main() -> anyhow::Result<()> {
    mlx_support::use_device(mlx_support::best_device())?;
    let a = mlx_rs::ops::arange::<_, f32>(None, 64 * 64, None)?
        .reshape(&[64, 64])?
        .divide(mlx_rs::Array::from_f32(4096.0))?;
    let sum = a.matmul(&a)?.sum(None)?;
    sum.eval()?;
    println!(
        "{} {}",
        mlx_support::kernels_in_use().unwrap_or_else(|| "none".into()),
        sum.item_exact::<f32>()
    );
    Ok(())
}
