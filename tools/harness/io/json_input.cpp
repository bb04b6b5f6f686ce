#include "tools/harness/io/json_input.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <set>
#include <vector>

#include "tools/harness/io/input_error.h"

namespace kvcheck {

using json = nlohmann::json;

namespace {

// JSON allows a key twice and keeps the last; a scenario that says "seed" twice is a
// mistake, so the parser's callback refuses it, naming the path. It also refuses nesting
// deeper than any kvcheck file needs, before a deep document can exhaust the stack.
class StrictJson {
 public:
  explicit StrictJson(const std::string& file) : file_(file) {}
  bool operator()(int depth, json::parse_event_t event, json& parsed) {
    using E = json::parse_event_t;
    if (depth > kMaxJsonDepth)
      throw InputError(file_, path(), fmt::format("nested deeper than {} levels", kMaxJsonDepth));
    switch (event) {
      case E::object_start:
        enter(true);
        break;
      case E::array_start:
        enter(false);
        break;
      case E::key: {
        Frame& f = frames_.back();
        f.name = parsed.get<std::string>();
        if (!f.keys.insert(f.name).second) throw InputError(file_, path(), "the key appears twice in this object");
        break;
      }
      case E::object_end:
      case E::array_end:
        frames_.pop_back();
        done_value();
        break;
      case E::value:
        done_value();
        break;
    }
    return true;
  }

 private:
  struct Frame {
    bool object;
    std::set<std::string> keys;
    std::string name;   // the current key (objects)
    std::size_t index;  // the current element (arrays)
  };
  void enter(bool object) { frames_.push_back({object, {}, "", 0}); }
  void done_value() {
    if (!frames_.empty() && !frames_.back().object) ++frames_.back().index;
  }
  std::string path() const {
    std::string p;
    for (const Frame& f : frames_) p += "/" + (f.object ? f.name : std::to_string(f.index));
    return p;
  }
  const std::string& file_;
  std::vector<Frame> frames_;
};

}  // namespace

json parse_json(const std::string& text, const std::string& file) {
  try {
    return json::parse(text, StrictJson(file));
  } catch (const json::exception& e) {
    // nlohmann's message gives the line and column (or the number that overflowed); drop
    // its exception id.
    std::string what = e.what();
    if (const auto close = what.find("] "); what.rfind("[json.exception", 0) == 0 && close != std::string::npos)
      what = what.substr(close + 2);
    throw InputError(file, "", "not valid JSON: " + what);
  }
}

}  // namespace kvcheck
