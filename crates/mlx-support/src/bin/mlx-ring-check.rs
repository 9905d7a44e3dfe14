//! One rank of a small MLX job: checks that a job's ranks form MLX's ring
//! and that its collectives work between them (and shows how they fail).
//! Start one per rank with the launcher:
//!
//! ```text
//! cargo build -p mlx-support --bin mlx-ring-check
//! cargo xtask launch --hosts 127.0.0.1 -n 2 -- target/debug/mlx-ring-check collectives
//! ```
//!
//! Modes: `collectives` (all_sum, all_gather, and a send/receive between
//! ranks 0 and 1, printing `RESULT {json}`), `hop FLOATS TRIPS` (the
//! time of one send from rank to rank of FLOATS f32, from round trips), `exit-after-init` (forms the
//! group and exits: its peers see it gone), `recv-from-1` (forms the group
//! and waits to receive from rank 1, printing the error when rank 1 is
//! gone). `--timeout SECONDS` bounds the wait for the peers;
//! `--result-dir DIR` also writes each rank's result to `DIR/rank-N.json`.

use std::time::Duration;

use mlx_rs::{Array, Dtype};
use mlx_support::distributed::{Group, GroupConfig};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mode = args.first().map(String::as_str).unwrap_or("collectives");
    let timeout = match args.iter().position(|a| a == "--timeout") {
        Some(i) => args.get(i + 1).ok_or("--timeout SECONDS")?.parse()?,
        None => 30.0,
    };
    let config = GroupConfig::from_env()?.timeout(Duration::from_secs_f64(timeout));
    let group = match Group::init(&config) {
        Ok(g) => g,
        Err(e) => {
            println!("ERROR {e}");
            std::process::exit(3);
        }
    };
    let rank = group.rank();
    match mode {
        "collectives" => {
            let r = rank as f32 + 1.0;
            let sum = group.all_sum(&Array::from_slice(&[r, 2.0 * r], &[2]))?;
            // Collectives meet in the order the ranks evaluate them: each
            // is evaluated here before the next is made, as the Python peer
            // does.
            sum.eval()?;
            let gathered = group.all_gather(&Array::from_slice(&[rank as f32], &[1]))?;
            gathered.eval()?;
            let exchanged: Vec<f64> = if rank == 0 {
                group
                    .send(&Array::from_slice(&[1.5f32, 2.5], &[2]), 1)?
                    .eval()?;
                let got = group.recv(&[3], Dtype::Int32, 1)?;
                got.eval()?;
                got.as_slice::<i32>()
                    .iter()
                    .map(|&v| f64::from(v))
                    .collect()
            } else if rank == 1 {
                let got = group.recv(&[2], Dtype::Float32, 0)?;
                got.eval()?;
                group
                    .send(&Array::from_slice(&[7i32, 8, 9], &[3]), 0)?
                    .eval()?;
                got.as_slice::<f32>()
                    .iter()
                    .map(|&v| f64::from(v))
                    .collect()
            } else {
                Vec::new()
            };
            let result = serde_json::json!({
                "rank": rank,
                "size": group.size(),
                "all_sum": sum.as_slice::<f32>(),
                "all_gather": gathered.as_slice::<f32>(),
                "exchanged": exchanged,
            });
            println!("RESULT {result}");
            // Also as a file, for launchers whose output forwarding may
            // lose a line as the job ends.
            if let Some(i) = args.iter().position(|a| a == "--result-dir") {
                let dir = args.get(i + 1).ok_or("--result-dir DIR")?;
                let path = std::path::Path::new(dir).join(format!("rank-{rank}.json"));
                std::fs::write(path, result.to_string())?;
            }
        }
        "hop" => {
            // Round trips of `floats` f32 between ranks 0 and 1: what one
            // pipeline hop of a hidden state costs.
            let floats: i32 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(576);
            let trips: usize = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(200);
            let x = mlx_rs::ops::ones::<f32>(&[floats])?;
            x.eval()?;
            let round_trip = || -> Result<(), Box<dyn std::error::Error>> {
                if rank == 0 {
                    group.send(&x, 1)?.eval()?;
                    group.recv(&[floats], Dtype::Float32, 1)?.eval()?;
                } else if rank == 1 {
                    let got = group.recv(&[floats], Dtype::Float32, 0)?;
                    got.eval()?;
                    group.send(&got, 0)?.eval()?;
                }
                Ok(())
            };
            for _ in 0..10 {
                round_trip()?;
            }
            let start = std::time::Instant::now();
            for _ in 0..trips {
                round_trip()?;
            }
            let hop_us = start.elapsed().as_secs_f64() * 1e6 / (2 * trips) as f64;
            println!(
                "RESULT {}",
                serde_json::json!({"rank": rank, "bytes": floats * 4, "hop_us": hop_us})
            );
        }
        "exit-after-init" => {
            println!("formed rank {rank}");
        }
        "recv-from-1" => {
            let got = group.recv(&[4], Dtype::Float32, 1)?;
            match got.eval() {
                Ok(()) => println!("RESULT received {:?}", got.as_slice::<f32>()),
                Err(e) => {
                    println!("ERROR {e}");
                    std::process::exit(4);
                }
            }
        }
        other => return Err(format!("unknown mode {other:?}").into()),
    }
    Ok(())
}
