package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// The library is built once per test binary, into a temporary directory.
var (
	libOnce sync.Once
	libDir  string
	libErr  error
	libOut  []byte
)

func TestMain(m *testing.M) {
	code := m.Run()
	if libDir != "" {
		os.RemoveAll(libDir)
	}
	os.Exit(code)
}

// buildLib builds libkvoffload.so (go build -buildmode=c-shared) and returns
// the directory holding it.
func buildLib(t *testing.T) string {
	t.Helper()
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go command in PATH to build the shared library")
	}
	if _, err := exec.LookPath("gcc"); err != nil {
		t.Skip("no gcc: cannot build a c-shared library")
	}
	libOnce.Do(func() {
		if libDir, libErr = os.MkdirTemp("", "kvoffload-capi-"); libErr != nil {
			return
		}
		cmd := exec.Command(goBin, "build", "-buildmode=c-shared", "-o", filepath.Join(libDir, "libkvoffload.so"), ".")
		cmd.Env = append(os.Environ(), "CGO_ENABLED=1")
		libOut, libErr = cmd.CombinedOutput()
	})
	require.NoError(t, libErr, "building libkvoffload.so: %s", libOut)
	return libDir
}

// TestABI compiles test/abi_test.c against kvoffload.h and the library and
// runs it (host backend, pthreads, fork).
func TestABI(t *testing.T) {
	dir := buildLib(t)
	exe := filepath.Join(t.TempDir(), "abi_test")
	out, err := exec.Command("gcc", "-std=c11", "-D_GNU_SOURCE", "-Wall", "-Wextra", "-Werror", "-O1",
		"-I.", "-o", exe, "test/abi_test.c", "-L"+dir, "-lkvoffload", "-Wl,-rpath,"+dir, "-lpthread").CombinedOutput()
	require.NoError(t, err, "gcc: %s", out)
	out, err = exec.Command(exe).CombinedOutput()
	require.NoError(t, err, "abi_test: %s", out)
	require.Contains(t, string(out), "abi_test: ok")
}

// TestHeaderMatchesExports checks that every function kvoffload.h declares
// is exported by the library, with no cgo-generated header needed.
func TestHeaderMatchesExports(t *testing.T) {
	dir := buildLib(t)
	nm, err := exec.LookPath("nm")
	if err != nil {
		t.Skip("no nm")
	}
	out, err := exec.Command(nm, "-D", "--defined-only", filepath.Join(dir, "libkvoffload.so")).CombinedOutput()
	require.NoError(t, err, "%s", out)
	exported := map[string]bool{}
	for _, line := range strings.Split(string(out), "\n") {
		if f := strings.Fields(line); len(f) == 3 {
			exported[f[2]] = true
		}
	}
	header, err := os.ReadFile("kvoffload.h")
	require.NoError(t, err)
	var declared []string
	for _, line := range strings.Split(string(header), "\n") {
		if i := strings.Index(line, "kvo_"); i >= 0 && strings.Contains(line, "(") && !strings.HasPrefix(strings.TrimSpace(line), "*") && !strings.HasPrefix(strings.TrimSpace(line), "/*") && !strings.HasPrefix(line, "#") {
			name := line[i : strings.Index(line[i:], "(")+i]
			if !strings.ContainsAny(name, " \t") {
				declared = append(declared, name)
			}
		}
	}
	require.GreaterOrEqual(t, len(declared), 24, "declarations found: %v", declared)
	for _, name := range declared {
		require.True(t, exported[name], "%s is declared in kvoffload.h but not exported", name)
	}
}

// TestPython runs the Python package's unit tests (python/tests, host
// backend) against the library built here.
func TestPython(t *testing.T) {
	dir := buildLib(t)
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("no python3")
	}
	cmd := exec.Command(py, "-m", "unittest", "discover", "-s", "tests", "-t", ".", "-v")
	cmd.Dir = filepath.Join("..", "python")
	cmd.Env = append(os.Environ(), "KVOFFLOAD_LIB="+filepath.Join(dir, "libkvoffload.so"), "PYTHONDONTWRITEBYTECODE=1")
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "python tests:\n%s", out)
	t.Logf("%s", out)
}
