//! Work a request leaves for after its answer has gone out.
//!
//! What an answer says is also bookkeeping: the request metrics, the client's share of MLflow,
//! the run's write queue, what run health hears. None of it changes the answer, and the client
//! need not wait for it: a step attaches it to the response ([`defer`]) instead of doing it on
//! the way out, and the outermost step ([`crate::plumbing::layers::observe`]) hands it to a task
//! of its own, spawned on the serving thread. A serving thread's runtime runs a spawned task
//! once the task that spawned it yields, and the connection's task yields after it has written
//! the answer: the work runs right after, on the same thread, before the thread reads anything
//! new from its connections (the runtime turns to its sockets when its queue is empty).
//!
//! Nothing deferred is lost: work whose response never reaches that step (a handler's answer a
//! test reads, a response dropped on the way) runs when the response is dropped.

use std::sync::{Arc, Mutex, PoisonError};

use axum::response::Response;

type Job = Box<dyn FnOnce() + Send>;

/// The work attached to a response, in the order it was attached; it runs when the last handle
/// on it is dropped (see the module).
#[derive(Clone, Default)]
pub(crate) struct AfterAnswer(Arc<Mutex<Jobs>>);

#[derive(Default)]
struct Jobs(Vec<Job>);

impl Drop for Jobs {
    fn drop(&mut self) {
        for job in self.0.drain(..) {
            job();
        }
    }
}

/// Attaches `job` to `response`, to run after it has been written (see the module).
pub(crate) fn defer(response: &mut Response, job: impl FnOnce() + Send + 'static) {
    let extensions = response.extensions_mut();
    let after = match extensions.get_mut::<AfterAnswer>() {
        Some(after) => after,
        None => {
            extensions.insert(AfterAnswer::default());
            extensions
                .get_mut::<AfterAnswer>()
                .expect("inserted just now")
        }
    };
    after
        .0
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .0
        .push(Box::new(job));
}

/// Takes the work attached to `response`, to be dropped (run) where the caller chooses.
pub(crate) fn take(response: &mut Response) -> Option<AfterAnswer> {
    response.extensions_mut().remove::<AfterAnswer>()
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[test]
    fn deferred_work_runs_once_in_order_when_taken_or_when_the_response_is_dropped() {
        let order = Arc::new(Mutex::new(Vec::new()));
        let push = |n: usize| {
            let order = order.clone();
            move || order.lock().unwrap().push(n)
        };
        let mut response = Response::new(axum::body::Body::empty());
        defer(&mut response, push(1));
        defer(&mut response, push(2));
        assert!(
            order.lock().unwrap().is_empty(),
            "nothing runs when attached"
        );
        let taken = take(&mut response).expect("attached work");
        assert!(take(&mut response).is_none());
        drop(response);
        assert!(
            order.lock().unwrap().is_empty(),
            "taken: not the response's any more"
        );
        drop(taken);
        assert_eq!(*order.lock().unwrap(), [1, 2]);

        let ran = Arc::new(AtomicUsize::new(0));
        let mut response = Response::new(axum::body::Body::empty());
        let counted = ran.clone();
        defer(&mut response, move || {
            counted.fetch_add(1, Ordering::SeqCst);
        });
        drop(response);
        assert_eq!(
            ran.load(Ordering::SeqCst),
            1,
            "a dropped response runs its work"
        );
    }
}
