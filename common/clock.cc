#include "common/clock.h"

namespace kvrelay {

Clock* Clock::Real() {
  static RealClock* clock = new RealClock();
  return clock;
}

}  // namespace kvrelay
