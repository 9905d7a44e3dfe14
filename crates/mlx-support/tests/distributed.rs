//! MLX's distributed engine from Rust: ranks started as child processes on
//! 127.0.0.1 (never another address), each bounded in time and ended by the
//! launcher whatever happens.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use mlx_support::distributed::{Hostfile, Launch, LaunchError, RankExit};
use serde_json::Value;

/// The rank program: this crate's `mlx-ring-check`.
fn ring_rank() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_mlx-ring-check"))
}

/// `child`'s exit, waiting until `seconds` after `start`; past that it is
/// killed and the test fails, naming `what`.
fn exit_within(
    child: &mut std::process::Child,
    start: Instant,
    seconds: u64,
    what: &str,
) -> std::process::ExitStatus {
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if start.elapsed() > Duration::from_secs(seconds) {
            child.kill().unwrap();
            child.wait().unwrap();
            panic!("{what} did not end within {seconds} s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn results(ranks: &[RankExit]) -> Vec<Value> {
    ranks
        .iter()
        .map(|r| {
            let line = r
                .output
                .iter()
                .find_map(|l| l.strip_prefix("RESULT "))
                .unwrap_or_else(|| panic!("rank {} printed no result: {:#?}", r.rank, r.output));
            serde_json::from_str(line).unwrap()
        })
        .collect()
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

#[test]
fn rust_ranks_sum_gather_and_exchange_over_mlxs_ring() {
    for n in [2usize, 3] {
        let ranks = Launch::new(&["127.0.0.1"], n, ring_rank())
            .args(["collectives"])
            .timeout(Duration::from_secs(90))
            .echo(false)
            .run()
            .unwrap();
        let results = results(&ranks);
        let total: f64 = (1..=n).map(|r| r as f64).sum();
        let ranks_list: Vec<f64> = (0..n).map(|r| r as f64).collect();
        for (rank, r) in results.iter().enumerate() {
            assert_eq!(r["rank"], rank);
            assert_eq!(r["size"], n);
            assert_eq!(floats(&r["all_sum"]), [total, 2.0 * total]);
            assert_eq!(floats(&r["all_gather"]), ranks_list);
        }
        assert_eq!(floats(&results[0]["exchanged"]), [7.0, 8.0, 9.0]);
        assert_eq!(floats(&results[1]["exchanged"]), [1.5, 2.5]);
    }
}

/// The proof that this is MLX's engine, not one of ours: a Rust rank and a
/// Python `mlx` rank form one ring and compute one all_sum, one all_gather
/// and an exchange of arrays.
#[test]
fn a_rust_rank_and_a_python_mlx_rank_form_one_job() {
    let test = "a_rust_rank_and_a_python_mlx_rank_form_one_job";
    let Some(python) = test_support::python::python_with(test, "mlx.core") else {
        return;
    };
    let peer = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/ring_peer.py");
    for python_rank in [1usize, 0] {
        let ranks = Launch::new(&["127.0.0.1"], 2, ring_rank())
            .args(["collectives"])
            .rank_command(python_rank, &python, [peer])
            .timeout(Duration::from_secs(90))
            .echo(false)
            .run()
            .unwrap();
        let results = results(&ranks);
        for r in &results {
            assert_eq!(floats(&r["all_sum"]), [3.0, 6.0]);
            assert_eq!(floats(&r["all_gather"]), [0.0, 1.0]);
        }
        assert_eq!(floats(&results[0]["exchanged"]), [7.0, 8.0, 9.0]);
        assert_eq!(floats(&results[1]["exchanged"]), [1.5, 2.5]);
    }
}

/// One rank of a two-rank job started alone: rank 0 waits for a peer that
/// never connects, rank 1 connects to a port nobody listens on. Each gives
/// a typed error within its timeout (3 s) instead of MLX's unbounded wait.
#[test]
fn a_peer_that_never_connects_is_an_error_within_the_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("hostfile.json");
    let ports: Vec<u16> = (0..2)
        .map(|_| {
            std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port()
        })
        .collect();
    let addrs = ports
        .iter()
        .map(|&p| vec![([127, 0, 0, 1], p).into()])
        .collect();
    Hostfile::new(addrs).unwrap().write(&path).unwrap();
    for rank in [0, 1] {
        let start = Instant::now();
        let mut child = Command::new(ring_rank())
            .args(["collectives", "--timeout", "3"])
            .env("MLX_RANK", rank.to_string())
            .env("MLX_HOSTFILE", &path)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let status = exit_within(&mut child, start, 30, &format!("rank {rank} alone"));
        let out = std::io::read_to_string(child.stdout.take().unwrap()).unwrap();
        assert_eq!(status.code(), Some(3), "rank {rank}: {out}");
        assert!(
            out.contains(&format!(
                "ERROR rank {rank} of 2: the group did not form within 3s"
            )),
            "rank {rank}: {out}"
        );
    }
}

/// A rank that exits after the group formed: its peer's receive fails with
/// MLX's error (the socket closed), and the launcher reports the failed
/// rank and ends the job.
#[test]
fn a_rank_that_dies_fails_its_peers_receive_and_the_launch() {
    let err = Launch::new(&["127.0.0.1"], 2, ring_rank())
        .args(["recv-from-1"])
        .rank_command(1, ring_rank(), ["exit-after-init"])
        .timeout(Duration::from_secs(90))
        .echo(false)
        .run()
        .unwrap_err();
    let LaunchError::RankFailed { rank, ranks, .. } = err else {
        panic!("expected a failed rank, got {err}");
    };
    assert_eq!(rank, 0);
    let said = ranks[0].output.join("\n");
    assert!(
        said.contains("ERROR") && said.contains("connection to a peer was lost"),
        "{said}"
    );
    assert!(ranks[1].status.is_some_and(|s| s.success()));
}

/// When a rank fails, its peers are not killed at once: a peer that fails
/// a moment later (as every rank of a handshake that disagrees does) keeps
/// its own error and exit code; one still running after the grace period is
/// killed. Ranks are `sh` scripts.
#[cfg(unix)]
#[test]
fn the_peers_of_a_failed_rank_get_the_grace_period_to_say_their_own_error() {
    use std::os::unix::process::ExitStatusExt;
    let start = Instant::now();
    let err = Launch::new(&["127.0.0.1"], 3, "sh")
        .args(["-c", "exit 3"])
        .rank_command(1, "sh", ["-c", "sleep 1; echo ERROR my own half; exit 4"])
        .rank_command(2, "sh", ["-c", "exec sleep 60"])
        .grace(Duration::from_secs(3))
        .timeout(Duration::from_secs(90))
        .echo(false)
        .run()
        .unwrap_err();
    let LaunchError::RankFailed { rank, ranks, .. } = err else {
        panic!("expected a failed rank, got {err}");
    };
    assert_eq!(rank, 0);
    assert_eq!(ranks[0].status.and_then(|s| s.code()), Some(3));
    assert_eq!(ranks[1].output, ["ERROR my own half"]);
    assert_eq!(ranks[1].status.and_then(|s| s.code()), Some(4));
    assert_eq!(
        ranks[2].status.and_then(|s| s.signal()),
        Some(libc::SIGKILL)
    );
    assert!(start.elapsed() < Duration::from_secs(30));
}

#[test]
fn a_launch_past_its_deadline_ends_every_rank() {
    // Rank 0 waits (up to 60 s) for a rank 1 that sleeps past the deadline.
    let start = Instant::now();
    let err = Launch::new(&["127.0.0.1"], 2, ring_rank())
        .args(["collectives", "--timeout", "60"])
        .rank_command(1, "sleep", ["60"])
        .timeout(Duration::from_secs(2))
        .echo(false)
        .run()
        .unwrap_err();
    assert!(matches!(err, LaunchError::Timeout { .. }), "{err}");
    assert!(start.elapsed() < Duration::from_secs(20));
}

/// The other direction of the hostfile contract: Python's `mlx.launch`
/// starts our rank program, and the ranks form their ring.
#[test]
fn pythons_mlx_launch_starts_rust_ranks() {
    let test = "pythons_mlx_launch_starts_rust_ranks";
    let Some(python) = test_support::python::python_with(test, "mlx.core") else {
        return;
    };
    let launcher = PathBuf::from(&python).with_file_name("mlx.launch");
    if !launcher.is_file() {
        eprintln!("SKIP {test}: no mlx.launch beside {python}");
        return;
    }
    let results = tempfile::tempdir().unwrap();
    let mut child = Command::new(&launcher)
        .args(["--hosts", "127.0.0.1", "-n", "2", "--backend", "ring"])
        .arg(ring_rank())
        .args(["collectives", "--result-dir"])
        .arg(results.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let status = exit_within(&mut child, Instant::now(), 90, "mlx.launch's job");
    assert!(status.success());
    // From the ranks' files: mlx.launch's forwarding can lose a rank's last
    // line as the job ends.
    for rank in 0..2 {
        let text = std::fs::read_to_string(results.path().join(format!("rank-{rank}.json")))
            .unwrap_or_else(|e| panic!("rank {rank} wrote no result: {e}"));
        let r: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(floats(&r["all_sum"]), [3.0, 6.0], "rank {rank}");
        assert_eq!(r["size"], 2);
    }
}
