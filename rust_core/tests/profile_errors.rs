mod common;
use common::*;
use tensorplace_core::CoreError;

fn err(p: tensorplace_core::Profile) -> String {
    match p.graph() {
        Err(CoreError::InvalidProfile(m)) => m,
        other => panic!("expected an invalid profile, got {other:?}"),
    }
}

#[test]
fn cycles_are_named() {
    let mut units = wire(vec![unit("a", &[], 1.0, 1.0, 1), unit("b", &[0], 1.0, 1.0, 1)]);
    units[0].inputs = vec![1];
    let m = err(profile(units, 0, 1.0));
    assert!(m.contains("cycle") && m.contains("(a)") && m.contains("(b)"), "{m}");
}

#[test]
fn unknown_inputs_negative_sizes_and_bad_bandwidth_are_refused() {
    let units = vec![unit("a", &[5], 1.0, 1.0, 1)];
    assert!(err(profile(wire(vec![unit("x", &[], 1.0, 1.0, 1)]).into_iter().chain(units).collect(), 0, 1.0))
        .contains("unknown unit 5"));
    let mut u = wire(vec![unit("a", &[], 1.0, 1.0, 1)]);
    u[0].act_bytes = -3;
    assert!(err(profile(u, 0, 1.0)).contains("negative act_bytes"));
    let m = err(profile(wire(vec![unit("a", &[], 1.0, 1.0, 1)]), 0, 0.0));
    assert!(m.contains("d2h_bandwidth"), "{m}");
    let mut u = wire(vec![unit("a", &[], -1.0, 1.0, 1)]);
    u[0].fwd_time = f64::NAN;
    assert!(err(profile(u, 0, 1.0)).contains("fwd_time"));
}

#[test]
fn json_round_trip_and_version_check() {
    let p = chain(&[1.0, 2.0], &[3, 4], 5, 6.0);
    let text = p.to_json();
    let back = tensorplace_core::Profile::from_json(&text).unwrap();
    assert_eq!(back, p);
    assert_eq!(back.fingerprint(), p.fingerprint());
    let newer = text.replace("\"version\": 1", "\"version\": 2");
    match tensorplace_core::Profile::from_json(&newer) {
        Err(CoreError::Format(m)) => assert!(m.contains("version 2"), "{m}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn replay_and_lingering_fields_are_checked() {
    let mut u = wire(vec![unit("a", &[], 1.0, 1.0, 4), unit("b", &[0], 1.0, 1.0, 4), unit("c", &[], 1.0, 1.0, 4)]);
    u[1].saved_inputs = Some(vec![2]);
    assert!(err(profile(u.clone(), 0, 1.0)).contains("saved_inputs must be a subset of inputs"));
    u[1].saved_inputs = Some(vec![0]);
    u[0].lingering_bytes = Some(5);
    u[0].lingering_until = Some(2);
    assert!(err(profile(u.clone(), 0, 1.0)).contains("above its act_bytes"));
    u[0].lingering_bytes = Some(3);
    u[0].lingering_until = Some(4);
    assert!(err(profile(u.clone(), 0, 1.0)).contains("lingering_until"));
    u[0].lingering_until = Some(3); // after the forward
    let p = profile(u, 0, 1.0);
    assert!(p.graph().is_ok());
    // the new fields survive JSON and enter the fingerprint
    let back = tensorplace_core::Profile::from_json(&p.to_json()).unwrap();
    assert_eq!(back, p);
    let mut q = p.clone();
    q.units[0].lingering_bytes = Some(2);
    assert_ne!(q.fingerprint(), p.fingerprint());
}
