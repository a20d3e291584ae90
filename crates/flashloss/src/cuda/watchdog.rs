//! The watchdog of a communicator's collectives ([`super::Nccl`]): a collective that
//! outlives the timeout is ended by aborting the communicator, with three rules.
//!
//! - **Abort only during a call.** The watchdog aborts only while a collective is in
//!   [`Phase::InCall`] (NCCL's `ncclCommAbort` is meant to end an operation blocked on
//!   another thread); once aborted, no call enters the communicator again, so nothing
//!   uses it after it is freed.
//! - **The collective decides its outcome.** A collective that completed returns its data
//!   even if the watchdog fired as it completed; the communicator is then dead and the
//!   next collective is an error on this rank, and (blocked on it) a timeout on its
//!   peers: so every rank of a group sees the same results, and the same failure at the
//!   same collective.
//! - **Once.** The abort runs at most once.
//!
//! Written over an abort callback, so the state machine is tested on the host.

use crate::error::{Error, Result};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Where a communicator is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// No collective runs.
    Idle,
    /// A collective runs (its calls into the communicator and the wait for them).
    InCall,
    /// Aborted: no call may enter the communicator.
    Aborted,
}

/// A communicator's phase and its abort (called at most once, under the phase lock).
pub(crate) struct Watchdog {
    phase: Mutex<Phase>,
    abort: Box<dyn Fn() + Send + Sync>,
}

impl Watchdog {
    /// A watchdog whose abort runs `abort`.
    pub(crate) fn new(abort: impl Fn() + Send + Sync + 'static) -> Arc<Self> {
        Arc::new(Watchdog {
            phase: Mutex::new(Phase::Idle),
            abort: Box::new(abort),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Phase> {
        self.phase.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Aborts now if no collective has made the communicator unusable yet (on drop of
    /// the communicator); whether this call aborted.
    pub(crate) fn abort_now(&self) -> bool {
        let mut phase = self.lock();
        if *phase == Phase::Aborted {
            return false;
        }
        (self.abort)();
        *phase = Phase::Aborted;
        true
    }

    /// Runs `call` (one collective) with a deadline of `timeout` (none: no watchdog).
    /// `aborted` is the error of a collective the watchdog ended, or of a call on an
    /// aborted communicator. Callers must not overlap calls (the communicator's own lock).
    pub(crate) fn run<T>(
        self: &Arc<Self>,
        timeout: Option<Duration>,
        aborted: impl Fn() -> Error,
        call: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        {
            let mut phase = self.lock();
            if *phase == Phase::Aborted {
                return Err(aborted());
            }
            *phase = Phase::InCall;
        }
        let Some(timeout) = timeout else {
            let out = call();
            self.leave();
            return out;
        };
        let (done, wait) = mpsc::channel::<()>();
        let me = self.clone();
        let watchdog = std::thread::spawn(move || {
            if let Err(RecvTimeoutError::Timeout) = wait.recv_timeout(timeout) {
                let mut phase = me.lock();
                if *phase == Phase::InCall {
                    (me.abort)();
                    *phase = Phase::Aborted;
                }
            }
        });
        let out = call();
        let _ = done.send(());
        let _ = watchdog.join();
        let aborted_now = !self.leave();
        match out {
            Ok(v) => Ok(v),
            Err(_) if aborted_now => Err(aborted()),
            Err(e) => Err(e),
        }
    }

    /// Back to idle after a collective; false when the communicator was aborted.
    fn leave(&self) -> bool {
        let mut phase = self.lock();
        if *phase == Phase::Aborted {
            return false;
        }
        *phase = Phase::Idle;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    impl Watchdog {
        fn phase(&self) -> Phase {
            *self.lock()
        }
    }

    fn counted() -> (Arc<Watchdog>, Arc<AtomicUsize>) {
        let aborts = Arc::new(AtomicUsize::new(0));
        let a = aborts.clone();
        (
            Watchdog::new(move || _ = a.fetch_add(1, Ordering::SeqCst)),
            aborts,
        )
    }

    fn aborted() -> Error {
        Error::Collective {
            reason: "aborted".into(),
        }
    }

    #[test]
    fn a_collective_within_the_timeout_never_aborts() {
        let (w, aborts) = counted();
        for _ in 0..3 {
            let out = w.run(Some(Duration::from_secs(5)), aborted, || Ok(7));
            assert_eq!(out.unwrap(), 7);
        }
        assert_eq!(aborts.load(Ordering::SeqCst), 0);
        assert_eq!(w.phase(), Phase::Idle);
    }

    #[test]
    fn a_blocked_collective_is_aborted_once_and_no_call_enters_after() {
        let (w, aborts) = counted();
        // The "collective" blocks until the abort, as ncclCommAbort ends a blocked
        // collective's kernels, and then fails.
        let w2 = w.clone();
        let out: Result<()> = w.run(Some(Duration::from_millis(50)), aborted, move || {
            while w2.phase() != Phase::Aborted {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(Error::Collective {
                reason: "the kernel ended".into(),
            })
        });
        assert_eq!(out.unwrap_err(), aborted());
        assert_eq!(aborts.load(Ordering::SeqCst), 1);
        let entered = AtomicUsize::new(0);
        let again: Result<()> = w.run(Some(Duration::from_secs(1)), aborted, || {
            entered.fetch_add(1, Ordering::SeqCst);
            Ok(())
        });
        assert_eq!(again.unwrap_err(), aborted());
        assert_eq!(
            entered.load(Ordering::SeqCst),
            0,
            "a call entered an aborted communicator"
        );
        assert!(!w.abort_now(), "aborted twice");
        assert_eq!(aborts.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_collective_that_completes_as_the_watchdog_fires_keeps_its_result() {
        let (w, aborts) = counted();
        let w2 = w.clone();
        // Completes only after the watchdog has aborted: its data is valid and returned;
        // the next collective is the error.
        let out = w.run(Some(Duration::from_millis(20)), aborted, move || {
            while w2.phase() != Phase::Aborted {
                std::thread::sleep(Duration::from_millis(2));
            }
            Ok(42)
        });
        assert_eq!(out.unwrap(), 42);
        assert_eq!(aborts.load(Ordering::SeqCst), 1);
        assert!(w.run(None, aborted, || Ok(1)).is_err());
    }

    #[test]
    fn without_a_timeout_errors_pass_through_and_drop_aborts_once() {
        let (w, aborts) = counted();
        let e = Error::Collective {
            reason: "peer".into(),
        };
        let e2 = e.clone();
        assert_eq!(w.run::<()>(None, aborted, move || Err(e2)).unwrap_err(), e);
        assert_eq!(w.phase(), Phase::Idle);
        assert!(w.abort_now());
        assert!(!w.abort_now());
        assert_eq!(aborts.load(Ordering::SeqCst), 1);
    }
}
