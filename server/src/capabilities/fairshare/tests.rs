use super::*;

fn config(rate: f64, samples: f64) -> FairShareConfig {
    FairShareConfig {
        client_write_rate: rate,
        client_sample_rate: samples,
        max_writes_at_mlflow: 0,
        teams: Vec::new(),
    }
}

fn share(config: &FairShareConfig) -> Arc<FairShare> {
    FairShare::new(config, TrustedProxies::default(), Metrics::new()).unwrap()
}

fn basic(user_password: &str) -> Credential {
    use base64::Engine as _;
    let mut headers = http::HeaderMap::new();
    let value = format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(user_password)
    );
    headers.insert(header::AUTHORIZATION, value.parse().unwrap());
    Credential::of(&headers).unwrap()
}

const API: &str = "/api/2.0/mlflow/runs/log-metric";

#[test]
fn a_client_is_its_authenticated_credential_else_its_address() {
    let share = share(&config(10.0, 0.0));
    let address: IpAddr = "10.1.2.3".parse().unwrap();
    let alice = basic("alice:secret");
    assert_eq!(alice.user.as_deref(), Some("alice"));
    assert_ne!(
        alice,
        basic("alice:guess"),
        "another password, another credential"
    );
    // Not yet accepted by MLflow: charged to the address.
    assert_eq!(
        share.key(Some(&alice), address).0,
        ClientKey::Address(address)
    );
    // MLflow refused it, or answered a route it answers to anyone: still the address.
    share.learn(&alice, API, StatusCode::UNAUTHORIZED);
    share.learn(&alice, API, StatusCode::FORBIDDEN);
    share.learn(&alice, "/health", StatusCode::OK);
    share.learn(&alice, "/version", StatusCode::OK);
    share.learn(&alice, "/api/3.0/mlflow/server-info", StatusCode::OK);
    share.learn(&alice, "/static-files/index.html", StatusCode::OK);
    share.learn(&alice, API, StatusCode::BAD_GATEWAY);
    assert_eq!(
        share.key(Some(&alice), address).0,
        ClientKey::Address(address)
    );
    share.learn(&alice, API, StatusCode::OK);
    assert_eq!(
        share.key(Some(&alice), address).0,
        ClientKey::Credential(alice.digest)
    );
    assert_eq!(share.key(None, address).0, ClientKey::Address(address));
    let mut bearer = http::HeaderMap::new();
    bearer.insert(header::AUTHORIZATION, "Bearer abc".parse().unwrap());
    let token = Credential::of(&bearer).unwrap();
    assert_eq!(token.user, None);
    bearer.insert(header::AUTHORIZATION, "Negotiate abc".parse().unwrap());
    assert_eq!(Credential::of(&bearer), None);
}

#[test]
fn writes_are_admitted_at_their_rate_and_samples_charged_once_answered() {
    let share = share(&config(10.0, 500.0));
    let start = Instant::now();
    let flood = ClientKey::Address("203.0.113.9".parse().unwrap());
    let calm = ClientKey::Address("198.51.100.1".parse().unwrap());
    for _ in 0..20 {
        share.admit(&flood, None, start).unwrap();
    }
    assert!(matches!(
        share.admit(&flood, None, start),
        Err(Refusal::ClientRate(_))
    ));
    share.admit(&calm, None, start).unwrap();
    // A write of 2,000 samples (twice the bucket) goes through, then its client waits two
    // seconds for its bucket to pay.
    let write = WriteState::default();
    share.answered(&write, &calm, &calm, None, 100, 2000, Some(true));
    let refused = share.admit(&calm, None, Instant::now()).unwrap_err();
    assert_eq!(refused.reason(), "client_samples");
    assert!(refused.wait() > Duration::from_millis(1900), "{refused:?}");
    let answer = share.refuse(refused, None);
    assert_eq!(answer.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        answer.headers()[header::RETRY_AFTER],
        refused.wait().as_secs_f64().ceil().to_string().as_str()
    );
    assert!(FairShare::new(&config(0.0, 0.0), TrustedProxies::default(), Metrics::new()).is_none());
}

#[test]
fn a_team_shares_its_quota_and_its_members_keep_their_own() {
    let mut settings = config(0.0, 0.0);
    settings.teams = vec![Team {
        name: "vision".into(),
        users: vec!["alice".into(), "bob".into()],
        write_rate: 5.0,
        sample_rate: 0.0,
    }];
    settings.validate().unwrap();
    let share = share(&settings);
    let address: IpAddr = "10.0.0.1".parse().unwrap();
    let (alice, bob, carol) = (basic("alice:a"), basic("bob:b"), basic("carol:c"));
    for c in [&alice, &bob, &carol] {
        share.learn(c, API, StatusCode::OK);
    }
    let (alice, team) = share.key(Some(&alice), address);
    assert_eq!(team, Some(0));
    let (bob, _) = share.key(Some(&bob), address);
    let (carol, none) = share.key(Some(&carol), address);
    assert_eq!(none, None);
    let now = Instant::now();
    for i in 0..10 {
        let member = if i % 2 == 0 { &alice } else { &bob };
        share.admit(member, team, now).unwrap();
    }
    assert!(matches!(
        share.admit(&bob, team, now),
        Err(Refusal::TeamRate(_))
    ));
    share.admit(&carol, none, now).unwrap();

    let mut twice = settings.clone();
    twice.teams.push(Team {
        name: "nlp".into(),
        users: vec!["bob".into()],
        write_rate: 1.0,
        sample_rate: 0.0,
    });
    assert!(twice.validate().unwrap_err().contains("\"bob\""));
}

#[test]
fn a_wrong_password_primed_on_health_cannot_spend_a_teams_quota() {
    // Finding 3: one `GET /health` as alice with a wrong password made the credential
    // "accepted", and its writes were charged to team vision.
    let mut settings = config(0.0, 0.0);
    settings.teams = vec![Team {
        name: "vision".into(),
        users: vec!["alice".into()],
        write_rate: 5.0,
        sample_rate: 0.0,
    }];
    let share = share(&settings);
    let address: IpAddr = "10.0.0.9".parse().unwrap();
    let guess = basic("alice:guess");
    share.learn(&guess, "/health", StatusCode::OK);
    assert_eq!(
        share.key(Some(&guess), address),
        (ClientKey::Address(address), None)
    );
}

#[test]
fn one_credential_spelled_many_ways_is_one_client() {
    let share = share(&config(10.0, 0.0));
    let address: IpAddr = "10.0.0.2".parse().unwrap();
    let spelled = |value: &str| {
        let mut headers = http::HeaderMap::new();
        headers.insert(header::AUTHORIZATION, value.parse().unwrap());
        Credential::of(&headers).unwrap()
    };
    // alice:secret
    share.learn(&spelled("Basic YWxpY2U6c2VjcmV0"), API, StatusCode::OK);
    let keys: HashSet<ClientKey> = [
        "basic YWxpY2U6c2VjcmV0",
        "BASIC YWxpY2U6c2VjcmV0",
        "Basic   YWxpY2U6c2VjcmV0 ",
    ]
    .iter()
    .map(|v| share.key(Some(&spelled(v)), address).0)
    .collect();
    assert_eq!(keys.len(), 1, "{keys:?}");
    assert!(matches!(
        keys.into_iter().next(),
        Some(ClientKey::Credential(_))
    ));
}

#[test]
fn the_maps_of_clients_and_credentials_stay_bounded_and_keep_the_recent_ones() {
    let share = share(&config(10.0, 0.0));
    let now = Instant::now();
    let flood = ClientKey::Address("203.0.113.9".parse().unwrap());
    for _ in 0..20 {
        share.admit(&flood, None, now).unwrap();
    }
    for i in 0..(MAX_CLIENTS as u32 + 10) {
        let other = ClientKey::Address(IpAddr::from(i.to_be_bytes()));
        share.admit(&other, None, now).unwrap();
        // The flood keeps writing: its emptied bucket is never the one forgotten.
        if i % 10_000 == 0 {
            assert!(share.admit(&flood, None, now).is_err());
        }
    }
    assert!(share.admit(&flood, None, now).is_err());
    let shares = share.shares.lock().unwrap();
    assert_eq!(shares.clients.len(), MAX_CLIENTS);
}

/// A share whose governor starts (and stays) at one write at MLflow at once, with a calm writer
/// heard and one heavy write of `flood` at MLflow: the flood's next write is held back.
fn saturated(flood: &ClientKey, calm: &ClientKey) -> (Arc<FairShare>, WriteState) {
    let mut c = config(0.0, 0.0);
    c.max_writes_at_mlflow = 1;
    let share = share(&c);
    let now = Instant::now();
    let calm_write = WriteState::default();
    share.admit(calm, None, now).unwrap();
    share.forwarded(&calm_write, calm, 150, now);
    share.answered(&calm_write, calm, calm, None, 150, 1, Some(true));
    let flood_write = WriteState::default();
    share.admit(flood, None, now).unwrap();
    share.forwarded(&flood_write, flood, 8000, now);
    assert!(matches!(
        share.admit(flood, None, now),
        Err(Refusal::Saturation { .. })
    ));
    (share, flood_write)
}

#[tokio::test(start_paused = true)]
async fn a_write_held_back_waits_for_its_turn_and_is_refused_only_after_waiting_too_long() {
    let flood = ClientKey::Address("203.0.113.9".parse().unwrap());
    let calm = ClientKey::Address("198.51.100.1".parse().unwrap());
    let (share, flood_write) = saturated(&flood, &calm);

    // The flood's next write waits; MLflow answers its write at MLflow: the waiting one has its
    // turn then, well before it would be refused.
    let waiter = tokio::spawn({
        let (share, flood) = (share.clone(), flood.clone());
        async move { share.admit_in_turn(&flood, None).await }
    });
    tokio::time::sleep(TURN_WAIT / 4).await;
    assert!(!waiter.is_finished(), "admitted while MLflow had no room");
    let answered_at = tokio::time::Instant::now();
    share.answered(&flood_write, &flood, &flood, None, 8000, 100, Some(true));
    let admitted = tokio::time::timeout(TURN_WAIT / 2, waiter).await;
    assert!(matches!(admitted, Ok(Ok(Ok(())))));
    assert!(answered_at.elapsed() < TURN_RECHECK);

    // With nothing answered, a waiting write is refused after `TURN_WAIT`, not before.
    let (share, _at_mlflow) = saturated(&flood, &calm);
    let started = tokio::time::Instant::now();
    let refused = share.admit_in_turn(&flood, None).await;
    assert!(matches!(refused, Err(Refusal::Saturation { .. })));
    assert!(started.elapsed() >= TURN_WAIT);
    assert_eq!(share.waiting.lock().unwrap().0, 0, "the place was given up");
}

#[tokio::test(start_paused = true)]
async fn the_writes_waiting_for_their_turn_are_bounded_per_client() {
    let flood = ClientKey::Address("203.0.113.9".parse().unwrap());
    let calm = ClientKey::Address("198.51.100.1".parse().unwrap());
    let (share, _at_mlflow) = saturated(&flood, &calm);
    let waiters: Vec<_> = (0..MAX_WAITING_PER_CLIENT)
        .map(|_| {
            let (share, flood) = (share.clone(), flood.clone());
            tokio::spawn(async move { share.admit_in_turn(&flood, None).await })
        })
        .collect();
    while share.waiting.lock().unwrap().0 < MAX_WAITING_PER_CLIENT {
        tokio::task::yield_now().await;
    }
    // One more of the same client is refused at once; the calm client is still admitted.
    let started = tokio::time::Instant::now();
    assert!(matches!(
        share.admit_in_turn(&flood, None).await,
        Err(Refusal::Saturation { .. })
    ));
    assert_eq!(started.elapsed(), Duration::ZERO);
    share.admit_in_turn(&calm, None).await.unwrap();
    // Clients that go away give their places up.
    for waiter in &waiters {
        waiter.abort();
    }
    for waiter in waiters {
        let _ = waiter.await;
    }
    assert_eq!(share.waiting.lock().unwrap().0, 0);
    assert!(share.waiting.lock().unwrap().1.is_empty());
}
