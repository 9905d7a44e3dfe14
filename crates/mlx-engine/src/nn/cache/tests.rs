//! The cache's windows and discarded positions.

use super::*;

fn positions(rows: i32, n: i32) -> Array {
    Array::zeros::<f32>(&[rows, 2, n, 4]).unwrap()
}

/// A layer with a window holds about a window of positions however long
/// the prompt; a layer without one holds them all.
#[test]
fn a_windowed_layer_holds_a_window_not_the_prompt() {
    let window = 8;
    let mut cache = KvCache::new();
    for step in 0..60 {
        let new = if step == 0 { 300 } else { 1 + step % 3 };
        let (k, v) = (positions(1, new), positions(1, new));
        cache.append(0, k.clone(), v.clone(), Some(window)).unwrap();
        cache.append(1, k, v, None).unwrap();
        cache.advance(new).unwrap();
        let held = |layer: usize| cache.owned[layer].as_ref().unwrap().keys.dim(2);
        assert!(
            held(0) <= window - 1 + GROW_BY + new,
            "step {step}: {} slots",
            held(0)
        );
        assert!(held(1) >= cache.own_len);
    }
    // The prefix a fork shares: the window's last positions only.
    let forked = cache.fork(3).unwrap();
    assert_eq!(forked.shared(0).unwrap().0.dim(1), window - 1);
    assert_eq!(forked.shared(1).unwrap().0.dim(1), cache.len());
    assert_eq!(forked.len(), cache.len());
}

/// A cache that discards its rows' positions hands a forward's keys and
/// values back as given, holds none of them, and refuses a second
/// forward rather than attend to positions it no longer has.
#[test]
fn a_cache_that_discards_owned_positions_holds_none() {
    let mut prefix = KvCache::new();
    prefix
        .append(0, positions(1, 5), positions(1, 5), None)
        .unwrap();
    prefix.advance(5).unwrap();
    let mut cache = prefix.fork(3).unwrap();
    cache.discard_owned();
    let (k, v) = (positions(3, 4), positions(3, 4));
    let (kk, vv) = cache.append(0, k.clone(), v.clone(), None).unwrap();
    assert_eq!((kk.shape(), vv.shape()), (k.shape(), v.shape()));
    cache.advance(4).unwrap();
    assert!(cache.owned.iter().all(Option::is_none));
    assert_eq!((cache.len(), cache.own_len), (9, 4));
    assert_eq!(cache.shared(0).unwrap().0.dim(1), 5, "the prefix stays");
    match cache.append(0, positions(3, 1), positions(3, 1), None) {
        Err(crate::Error::Cache(message)) => assert!(message.contains("keeps no")),
        other => panic!("{other:?}"),
    }
}
