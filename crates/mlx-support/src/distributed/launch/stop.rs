//! How a launch reaches its ranks to stop them: a signal to a local rank,
//! and for a remote one a wrapper script that ssh runs, which passes on the
//! signal names the launcher writes to the connection and kills its rank
//! when the connection ends.

use std::ffi::OsString;
use std::process::Child;

/// `s` quoted for a POSIX shell.
pub(super) fn quote(s: &std::ffi::OsStr) -> String {
    format!("'{}'", s.to_string_lossy().replace('\'', r"'\''"))
}

/// The shell script a remote rank runs: `setup`, then `program args…` with
/// `envs` in the background, while the script reads signal names (`TERM`,
/// `INT`) from its standard input — the launcher's end of the ssh
/// connection — and sends each to the program. When that input ends (the
/// launcher closed it, or died, and ssh with it) the program is killed.
/// The script exits with the program's status.
pub(super) fn remote_script(
    setup: &str,
    envs: &[(OsString, OsString)],
    program: &OsString,
    args: &[OsString],
) -> String {
    let mut command = String::new();
    for (k, v) in envs {
        command.push_str(&format!("{}={} ", k.to_string_lossy(), quote(v)));
    }
    command.push_str(&quote(program));
    for a in args {
        command.push(' ');
        command.push_str(&quote(a));
    }
    // An asynchronous command's standard input is /dev/null in a
    // non-interactive shell: the watcher reads the connection from fd 3.
    format!(
        "{setup} || exit 1\n\
         exec 3<&0\n\
         {command} </dev/null 3<&- &\n\
         pid=$!\n\
         ( while read -r sig <&3; do kill -s \"$sig\" \"$pid\" 2>/dev/null; done; \
         kill -s KILL \"$pid\" 2>/dev/null ) &\n\
         watcher=$!\n\
         exec 3<&-\n\
         wait \"$pid\"\n\
         status=$?\n\
         kill \"$watcher\" 2>/dev/null\n\
         exit \"$status\"\n"
    )
}

/// The name `kill -s` takes for `signal` (`TERM`, `INT`, …).
pub(super) fn signal_name(signal: i32) -> &'static str {
    #[cfg(unix)]
    {
        match signal {
            libc::SIGINT => "INT",
            libc::SIGHUP => "HUP",
            libc::SIGQUIT => "QUIT",
            libc::SIGKILL => "KILL",
            _ => "TERM",
        }
    }
    #[cfg(not(unix))]
    {
        let _ = signal;
        "TERM"
    }
}

/// Sends `signal` to a local rank (where there are no signals, ends it).
pub(super) fn send_signal(child: &mut Child, signal: i32) {
    #[cfg(unix)]
    {
        if let Ok(pid) = libc::pid_t::try_from(child.id()) {
            // SAFETY: kill(2) has no memory effects; the pid is our own
            // child's, not yet reaped (its status was not read), so it
            // cannot name another process.
            unsafe {
                libc::kill(pid, signal);
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = signal;
        let _ = child.kill();
    }
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader, Write};
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};

    /// The remote wrapper, run by a local `sh` as ssh would run it: a signal
    /// name written to its input reaches the program; its input closing
    /// kills the program; a program that ends by itself ends the script
    /// with its status.
    #[test]
    fn the_remote_wrapper_passes_signals_on_and_kills_its_rank_when_the_connection_closes() {
        let run = |program_script: &str| {
            let script = remote_script(
                "true",
                &[(OsString::from("GREETING"), OsString::from("it's here"))],
                &OsString::from("sh"),
                &[OsString::from("-c"), OsString::from(program_script)],
            );
            let mut child = Command::new("sh")
                .arg("-c")
                .arg(script)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .unwrap();
            let mut out = BufReader::new(child.stdout.take().unwrap());
            let mut line = String::new();
            out.read_line(&mut line).unwrap();
            let pid: i32 = line.trim().parse().unwrap_or_else(|_| panic!("{line:?}"));
            (child, pid, out)
        };
        let alive = |pid: i32| {
            // SAFETY: signal 0 only checks that the process exists.
            unsafe { libc::kill(pid, 0) == 0 }
        };
        let wait = |child: &mut Child| {
            let start = Instant::now();
            loop {
                if let Some(status) = child.try_wait().unwrap() {
                    return status;
                }
                assert!(
                    start.elapsed() < Duration::from_secs(20),
                    "the wrapper hangs"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        };
        // A signal name on the connection.
        let (mut child, pid, _) = run("echo $$; exec sleep 60");
        writeln!(child.stdin.as_mut().unwrap(), "TERM").unwrap();
        let status = wait(&mut child);
        assert_eq!(status.code(), Some(128 + libc::SIGTERM), "{status}");
        assert!(!alive(pid));
        // The connection closing, with a program that ignores TERM.
        let (mut child, pid, _) = run("trap '' TERM; echo $$; exec sleep 60");
        drop(child.stdin.take());
        let status = wait(&mut child);
        assert_eq!(status.code(), Some(128 + libc::SIGKILL), "{status}");
        assert!(!alive(pid));
        // A program that ends by itself, with the environment it was given.
        let (mut child, _, mut out) = run("echo $$; echo \"$GREETING\"; exit 3");
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "it's here");
        assert_eq!(wait(&mut child).code(), Some(3));
    }
}
