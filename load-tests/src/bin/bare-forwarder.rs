//! `bare-forwarder`: the floor of forwarding on mlscope-proxy's own stack, for `load-tests/perf`.
//!
//! One thread with a single-threaded tokio runtime (as each of the proxy's serving threads), a
//! hyper HTTP/1 server, and hyper HTTP/1 client connections kept open to the upstream. Each
//! request is sent on as it came, head and streamed body, with its target made origin-form; the
//! answer comes back the same way. Nothing else: no routes, layers, log lines, metrics, request
//! ids, header rewriting, body reads, limits or timeouts. Its own time per request is what the
//! proxy's stack costs before any of the proxy's work, set beside nginx's and the proxy's by
//! `legs.sh` and `instructions.sh`.
//!
//! It takes the flags those scripts give mlscope-proxy, and answers `GET /healthz` on the admin
//! address. Not for any other use: it trusts its one client and its upstream.

use std::cell::RefCell;
use std::net::SocketAddr;
use std::process::ExitCode;

use clap::Parser;
use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::client::conn::http1::SendRequest;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;

#[derive(Parser)]
#[command(
    about = "The floor of forwarding on mlscope-proxy's stack (hyper, tokio), for the perf scripts"
)]
struct Args {
    /// Where to forward (http://host:port).
    #[arg(long)]
    upstream: String,
    /// Where to serve.
    #[arg(long)]
    listen: SocketAddr,
    /// Where to answer `GET /healthz`.
    #[arg(long)]
    admin_listen: SocketAddr,
    /// Accepted, and unused, so the scripts start this as they start mlscope-proxy.
    #[arg(long)]
    database_url: Option<String>,
}

type Body = http_body_util::combinators::UnsyncBoxBody<Bytes, hyper::Error>;

thread_local! {
    /// Open connections to the upstream, idle or not (the serving thread's own).
    static POOL: RefCell<Vec<SendRequest<Incoming>>> = const { RefCell::new(Vec::new()) };
}

fn main() -> ExitCode {
    let args = Args::parse();
    let Some(upstream) = args
        .upstream
        .strip_prefix("http://")
        .map(|rest| rest.trim_end_matches('/').to_owned())
    else {
        eprintln!("bare-forwarder: --upstream must be http://host:port");
        return ExitCode::from(64);
    };
    let serving = std::thread::Builder::new()
        .name("bare-serve".into())
        .spawn(move || serve(args.listen, args.admin_listen, upstream));
    match serving.map(|thread| thread.join()) {
        Ok(Ok(Ok(()))) => ExitCode::SUCCESS,
        Ok(Ok(Err(error))) => {
            eprintln!("bare-forwarder: {error}");
            ExitCode::FAILURE
        }
        _ => ExitCode::FAILURE,
    }
}

fn serve(listen: SocketAddr, admin: SocketAddr, upstream: String) -> std::io::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let local = tokio::task::LocalSet::new();
    local.block_on(&runtime, async move {
        let listener = tokio::net::TcpListener::bind(listen).await?;
        let admin = tokio::net::TcpListener::bind(admin).await?;
        tokio::task::spawn_local(async move {
            while let Ok((stream, _)) = admin.accept().await {
                let healthz = service_fn(|_: Request<Incoming>| async {
                    Ok::<_, hyper::Error>(Response::new(Full::new(Bytes::from_static(b"OK"))))
                });
                tokio::task::spawn_local(
                    hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), healthz),
                );
            }
        });
        let upstream: &'static str = Box::leak(upstream.into_boxed_str());
        loop {
            let (stream, _) = listener.accept().await?;
            stream.set_nodelay(true)?;
            let service = service_fn(move |request| forward(request, upstream));
            tokio::task::spawn_local(
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service),
            );
        }
    })
}

async fn forward(
    mut request: Request<Incoming>,
    upstream: &'static str,
) -> Result<Response<Body>, hyper::Error> {
    if let Some(target) = request.uri().path_and_query().cloned() {
        *request.uri_mut() = target.into();
    }
    let mut sender = match idle_connection() {
        Some(sender) => sender,
        None => match connect(upstream).await {
            Ok(sender) => sender,
            Err(error) => return Ok(bad_gateway(&error.to_string())),
        },
    };
    let answer = sender.send_request(request).await;
    POOL.with(|pool| pool.borrow_mut().push(sender));
    Ok(answer?.map(BodyExt::boxed_unsync))
}

/// An open upstream connection ready for a request, closed ones dropped on the way.
fn idle_connection() -> Option<SendRequest<Incoming>> {
    POOL.with(|pool| {
        let mut pool = pool.borrow_mut();
        pool.retain(|sender| !sender.is_closed());
        let ready = pool.iter().position(SendRequest::is_ready)?;
        Some(pool.swap_remove(ready))
    })
}

async fn connect(upstream: &str) -> std::io::Result<SendRequest<Incoming>> {
    let stream = tokio::net::TcpStream::connect(upstream).await?;
    stream.set_nodelay(true)?;
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(std::io::Error::other)?;
    tokio::task::spawn_local(connection);
    Ok(sender)
}

fn bad_gateway(why: &str) -> Response<Body> {
    let mut response = Response::new(
        Full::new(Bytes::from(format!("upstream: {why}\n")))
            .map_err(|never| match never {})
            .boxed_unsync(),
    );
    *response.status_mut() = StatusCode::BAD_GATEWAY;
    response
}
