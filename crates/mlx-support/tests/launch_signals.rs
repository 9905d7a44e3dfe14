//! `mlx-launch` stopped by a signal, as `timeout`, a scheduler or a
//! terminal's Ctrl-C stop it: the signal reaches every rank, a rank that
//! ignores it is killed after the grace period, the launcher exits with
//! 128 + the signal, and no rank is left running. Ranks are `sh` scripts
//! on 127.0.0.1 that print their process id and sleep.

#![cfg(unix)]

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Whether process `pid` exists (zombies aside: the launcher reaps its
/// ranks).
fn alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    unsafe { libc::kill(pid, 0) == 0 }
}

/// Starts `mlx-launch -n 3` over a rank script, waits until every rank has
/// printed its pid, sends `signal` to the launcher, and returns the
/// launcher's exit code, how long it took to exit, and the ranks' pids.
fn signalled_launch(rank_script: &str, signal: i32) -> (Option<i32>, Duration, Vec<i32>) {
    let mut launcher = Command::new(env!("CARGO_BIN_EXE_mlx-launch"))
        .args(["-n", "3", "--timeout", "120", "--", "sh", "-c", rank_script])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = launcher.stdout.take().unwrap();
    let mut pids = Vec::new();
    let mut lines = BufReader::new(stdout).lines();
    while pids.len() < 3 {
        let line = lines
            .next()
            .expect("the launcher ended before every rank started")
            .unwrap();
        if let Some(pid) = line.split("PID ").nth(1) {
            pids.push(pid.trim().parse::<i32>().unwrap());
        }
    }
    let pid = i32::try_from(launcher.id()).unwrap();
    // SAFETY: the launcher is our child, not yet reaped.
    unsafe { libc::kill(pid, signal) };
    let sent = Instant::now();
    let deadline = sent + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = launcher.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = launcher.kill();
            for &p in &pids {
                // SAFETY: ending what the test started.
                unsafe { libc::kill(p, libc::SIGKILL) };
            }
            panic!("the launcher did not exit within 60 s of the signal");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    (status.code(), sent.elapsed(), pids)
}

#[test]
fn sigterm_or_sigint_to_the_launcher_ends_every_rank_and_fails_the_launch() {
    // `exec`: the rank's process is the sleep, which the signal ends.
    let rank = "echo PID $$; exec sleep 60";
    for (signal, code) in [(libc::SIGTERM, 143), (libc::SIGINT, 130)] {
        let (exit, took, pids) = signalled_launch(rank, signal);
        assert_eq!(exit, Some(code), "signal {signal}");
        assert!(took < Duration::from_secs(4), "signal {signal}: {took:?}");
        for pid in pids {
            assert!(
                !alive(pid),
                "signal {signal}: rank process {pid} is still running"
            );
        }
    }
}

#[test]
fn a_rank_that_ignores_the_signal_is_killed_after_the_grace_period() {
    let rank = "trap '' TERM; echo PID $$; exec sleep 60";
    let (exit, took, pids) = signalled_launch(rank, libc::SIGTERM);
    assert_eq!(exit, Some(143));
    // The default grace is 5 s.
    assert!(took >= Duration::from_secs(4), "{took:?}");
    for pid in pids {
        assert!(!alive(pid), "rank process {pid} is still running");
    }
}
