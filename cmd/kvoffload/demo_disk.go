package main

import (
	"fmt"

	"github.com/kvoffload/kvoffload/offload"
)

// diskTierError says why the disk tier --disk asked for is not wholly in
// use once the engine started: the engine starts without its disk tier
// when no directory is usable (missing, not a directory, too small for
// the records file's fallocate, a link planted in it...) and without the
// directories it could not use, saying why in its Stats. A demo given
// --disk explicitly fails then, naming the directories and the reason,
// rather than run without the tier it was asked to show. nil without
// --disk or with every directory in use.
func diskTierError(cfg demoConfig, st offload.Stats) error {
	if cfg.diskDir == "" {
		return nil
	}
	n := len(diskDirs(cfg.diskDir))
	switch {
	case st.Disk.Error != "" && n == 1:
		return fmt.Errorf("--disk %s: the disk tier is off, its directory is unusable: %s", cfg.diskDir, st.Disk.Error)
	case st.Disk.Error != "":
		return fmt.Errorf("--disk %s: the disk tier is off, none of its %d directories is usable: %s", cfg.diskDir, n, st.Disk.Error)
	case st.Disk.UnusableDirs > 0:
		return fmt.Errorf("--disk %s: %d of its %d directories unusable: %s", cfg.diskDir, st.Disk.UnusableDirs, n, st.Disk.UnusableError)
	}
	return nil
}
