#include "reference/policy.h"

#include <algorithm>

namespace kvcheck::reference {

std::int64_t evicted_count(const Policy& policy, std::int64_t t) {
  if (policy.kind != PolicyKind::sink) return 0;
  const std::int64_t over = std::max<std::int64_t>(0, t + 1 - policy.window);
  const std::int64_t k = policy.evict;
  return k * ((over + k - 1) / k);
}

namespace {

// V(t), Pk, Pq of the policy before SPEC 10.4's sliding window inside a sink policy.
QueryView unfiltered_view(const Policy& policy, std::int64_t t) {
  QueryView view;
  switch (policy.kind) {
    case PolicyKind::full:
      view.query_position = t;
      for (std::int64_t j = 0; j <= t; ++j) view.keys.push_back({j, j});
      break;
    case PolicyKind::sliding:
      view.query_position = t;
      for (std::int64_t j = std::max<std::int64_t>(0, t - policy.window + 1); j <= t; ++j) view.keys.push_back({j, j});
      break;
    case PolicyKind::chunked:  // SPEC 10.2: the query's own chunk, up to itself
      view.query_position = t;
      for (std::int64_t j = t / policy.window * policy.window; j <= t; ++j) view.keys.push_back({j, j});
      break;
    case PolicyKind::sink: {
      const std::int64_t s = policy.sinks;
      const std::int64_t e = evicted_count(policy, t);
      const bool shifted = policy.positions == SinkPositions::cache;
      view.query_position = shifted ? t - e : t;
      for (std::int64_t j = 0; j < std::min(s, t + 1); ++j) view.keys.push_back({j, j});
      for (std::int64_t j = s + e; j <= t; ++j) view.keys.push_back({j, shifted ? j - e : j});
      break;
    }
  }
  return view;
}

}  // namespace

QueryView streaming_view(const Policy& policy, std::int64_t t) {
  QueryView view = unfiltered_view(policy, t);
  if (policy.swa > 0)  // SPEC 10.4: of what the sink policy shows, the keys within swa positions
    std::erase_if(view.keys, [&](const VisibleKey& k) { return view.query_position - k.position >= policy.swa; });
  return view;
}

QueryView chunk_view(const Policy& policy, std::int64_t chunk_start, std::int64_t t) {
  if (policy.prefill == Prefill::streaming || t == chunk_start) return streaming_view(policy, t);

  // Dense: the whole chunk is one forward over what the cache held before it.
  QueryView view;
  for (const VisibleKey& key : streaming_view(policy, chunk_start).keys)
    if (key.index != chunk_start) view.keys.push_back(key);
  for (std::int64_t j = chunk_start; j <= t; ++j) view.keys.push_back({j, j});

  const bool absolute = policy.kind != PolicyKind::sink || policy.positions == SinkPositions::original;
  if (absolute) {
    for (VisibleKey& key : view.keys) key.position = key.index;
    view.query_position = t;
  } else {
    // A key's position is its place in the list.
    for (std::size_t place = 0; place < view.keys.size(); ++place)
      view.keys[place].position = static_cast<std::int64_t>(place);
    view.query_position = static_cast<std::int64_t>(view.keys.size()) - 1;
  }
  return view;
}

// SPEC 10.4: a sliding layer under a shift retains (and keeps live) what its sink policy
// does; its window only narrows what a query sees.
QueryView retained_view(const Policy& policy, std::int64_t length) {
  if (length == 0) return {};
  return unfiltered_view(policy, length - 1);
}

QueryView live_view(const Policy& policy, std::int64_t length) {
  QueryView view = unfiltered_view(policy, length);
  view.keys.pop_back();  // the next token itself is not in the cache yet
  return view;
}

QueryView seen_again_view(const Policy& policy, std::int64_t length) {
  QueryView view = live_view(policy, length);
  if (policy.swa <= 0) return view;
  const std::int64_t lowest_query = std::min(view.query_position, policy.window - policy.evict);
  std::erase_if(view.keys, [&](const VisibleKey& k) {
    const std::int64_t query = k.index < policy.sinks ? lowest_query : view.query_position;
    return query - k.position >= policy.swa;
  });
  return view;
}

std::int64_t crop_lacks(const Policy& policy, std::int64_t length, std::int64_t cut) {
  if (cut >= length) return -1;
  const bool narrowed = policy.swa > 0;
  const QueryView held = narrowed ? seen_again_view(policy, length) : retained_view(policy, length);
  for (const VisibleKey& needed : (narrowed ? seen_again_view(policy, cut) : retained_view(policy, cut)).keys)
    if (std::none_of(held.keys.begin(), held.keys.end(), [&](const VisibleKey& k) { return k.index == needed.index; }))
      return needed.index;
  return -1;
}

std::int64_t block_retained_length(std::int64_t length, std::int64_t capacity, std::int64_t window) {
  if (length <= capacity) return length;
  const std::int64_t evicted_at_once = capacity - window + 1;
  const std::int64_t evictions = (length - capacity + evicted_at_once - 1) / evicted_at_once;
  return length - evicted_at_once * evictions;
}

}  // namespace kvcheck::reference
