// Command configchild runs offload.New on one Config (JSON on stdin) and
// closes the engine: the child process of offload's FuzzNewConfig. Before
// New it limits its own address space (RLIMIT_AS) to what the Go runtime
// has mapped at start plus 1 GiB, so that an allocation proportional to a
// bad size fails instead of succeeding lazily. It exits 0 when New
// returned an engine or an error (printed), and never recovers a panic: a
// panic or a Go "fatal error" (heap exhausted) exits non-zero, which is
// what the target looks for.
package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/kvoffload/kvoffload/offload"
)

// budget is the address space New may use beyond the runtime's own.
const budget = 1 << 30

func main() {
	var cfg offload.Config
	if err := json.NewDecoder(os.Stdin).Decode(&cfg); err != nil {
		fmt.Fprintln(os.Stderr, "configchild: reading the Config:", err)
		os.Exit(2)
	}
	if err := limitAddressSpace(); err != nil {
		fmt.Fprintln(os.Stderr, "configchild:", err)
		os.Exit(2)
	}
	e, err := offload.New(cfg)
	if err != nil {
		fmt.Println("refused:", err)
		return
	}
	if err := e.Close(); err != nil {
		fmt.Println("close:", err)
	}
}

// limitAddressSpace sets RLIMIT_AS to the process's VmSize plus budget.
func limitAddressSpace() error {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		return err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "VmSize:"); ok {
			kb, err := strconv.ParseUint(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			if err != nil {
				return fmt.Errorf("VmSize %q: %w", rest, err)
			}
			lim := kb<<10 + budget
			return unix.Setrlimit(unix.RLIMIT_AS, &unix.Rlimit{Cur: lim, Max: lim})
		}
	}
	return fmt.Errorf("/proc/self/status has no VmSize")
}
