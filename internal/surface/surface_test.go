package surface

import (
	"bufio"
	"bytes"
	"go/ast"
	"go/doc"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

const module = "github.com/kvoffload/kvoffload"

// root is the module root, two levels up from this package.
var root = filepath.Join("..", "..")

// parsePkg parses dir's non-test Go files (every build tag: a file behind
// a tag is surface too).
func parsePkg(t *testing.T, dir string) (*token.FileSet, []*ast.File) {
	t.Helper()
	fset := token.NewFileSet()
	paths, err := filepath.Glob(filepath.Join(root, dir, "*.go"))
	if err != nil {
		t.Fatal(err)
	}
	var files []*ast.File
	for _, p := range paths {
		if strings.HasSuffix(p, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, p, nil, parser.ParseComments)
		if err != nil {
			t.Fatalf("parsing %s: %v", p, err)
		}
		files = append(files, f)
	}
	if len(files) == 0 {
		t.Fatalf("%s: no Go files", dir)
	}
	return fset, files
}

// exportedNames lists dir's exported top-level identifiers and the
// exported methods of its exported types.
func exportedNames(t *testing.T, dir string) []string {
	fset, files := parsePkg(t, dir)
	d, err := doc.NewFromFiles(fset, files, module+"/"+dir)
	if err != nil {
		t.Fatalf("%s: %v", dir, err)
	}
	var names []string
	for _, v := range append(d.Consts, d.Vars...) {
		names = append(names, v.Names...)
	}
	for _, f := range d.Funcs {
		names = append(names, f.Name)
	}
	for _, ty := range d.Types {
		names = append(names, ty.Name)
		for _, v := range append(ty.Consts, ty.Vars...) {
			names = append(names, v.Names...)
		}
		for _, f := range ty.Funcs {
			names = append(names, f.Name)
		}
		for _, m := range ty.Methods {
			names = append(names, ty.Name+"."+m.Name)
		}
	}
	return names
}

func TestBudgets(t *testing.T) {
	other := 0
	for _, dir := range Public {
		n := len(exportedNames(t, dir))
		t.Logf("%-16s %4d exported names", dir, n)
		if dir == "offload" {
			if n > MaxOffloadNames {
				t.Errorf("offload exports %d names, budget %d", n, MaxOffloadNames)
			}
			continue
		}
		other += n
	}
	t.Logf("%-16s %4d exported names", "the others", other)
	if other > MaxOtherNames {
		t.Errorf("the public packages but offload export %d names together, budget %d", other, MaxOtherNames)
	}
}

func TestOffloadDocLength(t *testing.T) {
	goTool, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("the go tool is needed to count `go doc -all ./offload`: %v", err)
	}
	cmd := exec.Command(goTool, "doc", "-all", "./offload")
	cmd.Dir = root
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go doc -all ./offload: %v", err)
	}
	n := bytes.Count(out, []byte("\n"))
	t.Logf("go doc -all ./offload: %d lines", n)
	if n > MaxOffloadDocAll {
		t.Errorf("go doc -all ./offload is %d lines, budget %d", n, MaxOffloadDocAll)
	}
}

// internalRefs returns the internal packages' identifiers that expr names
// (pkg.Name for an import of an internal path), given file's imports.
func internalRefs(imports map[string]string, n ast.Node) []string {
	var refs []string
	if n == nil {
		return nil
	}
	ast.Inspect(n, func(n ast.Node) bool {
		sel, ok := n.(*ast.SelectorExpr)
		if !ok {
			return true
		}
		if x, ok := sel.X.(*ast.Ident); ok {
			if path, ok := imports[x.Name]; ok && strings.Contains(path+"/", "/internal/") {
				refs = append(refs, x.Name+"."+sel.Sel.Name+" ("+path+")")
			}
		}
		return true
	})
	return refs
}

// exposedTypeExpr strips what an exported type does not expose: the
// unexported fields of a struct, the unexported methods of an interface.
func exposedTypeExpr(imports map[string]string, ty ast.Expr) []string {
	switch ty := ty.(type) {
	case *ast.StructType:
		var refs []string
		for _, f := range ty.Fields.List {
			exported := len(f.Names) == 0 // embedded: its fields are promoted
			for _, n := range f.Names {
				exported = exported || n.IsExported()
			}
			if exported {
				refs = append(refs, internalRefs(imports, f.Type)...)
			}
		}
		return refs
	case *ast.InterfaceType:
		var refs []string
		for _, f := range ty.Methods.List {
			exported := len(f.Names) == 0
			for _, n := range f.Names {
				exported = exported || n.IsExported()
			}
			if exported {
				refs = append(refs, internalRefs(imports, f.Type)...)
			}
		}
		return refs
	}
	return internalRefs(imports, ty)
}

func TestNoInternalTypesInPublicAPI(t *testing.T) {
	for _, dir := range Public {
		fset, files := parsePkg(t, dir)
		for _, f := range files {
			imports := map[string]string{}
			for _, im := range f.Imports {
				path, _ := strconv.Unquote(im.Path.Value)
				name := filepath.Base(path)
				if im.Name != nil {
					name = im.Name.Name
				}
				imports[name] = path
			}
			report := func(what string, pos token.Pos, refs []string) {
				for _, r := range refs {
					t.Errorf("%s: %s exposes %s", fset.Position(pos), what, r)
				}
			}
			for _, decl := range f.Decls {
				switch d := decl.(type) {
				case *ast.FuncDecl:
					if !d.Name.IsExported() {
						continue
					}
					if d.Recv != nil {
						recv := d.Recv.List[0].Type
						if st, ok := recv.(*ast.StarExpr); ok {
							recv = st.X
						}
						if ix, ok := recv.(*ast.IndexExpr); ok {
							recv = ix.X
						}
						if id, ok := recv.(*ast.Ident); !ok || !id.IsExported() {
							continue
						}
					}
					report(d.Name.Name, d.Pos(), internalRefs(imports, d.Type))
				case *ast.GenDecl:
					for _, spec := range d.Specs {
						switch s := spec.(type) {
						case *ast.TypeSpec:
							if s.Name.IsExported() {
								report(s.Name.Name, s.Pos(), exposedTypeExpr(imports, s.Type))
							}
						case *ast.ValueSpec:
							// Only a declared type: a value's type needs
							// type checking (an error variable that is
							// an internal one is an error, not a type).
							for _, n := range s.Names {
								if n.IsExported() {
									report(n.Name, n.Pos(), internalRefs(imports, s.Type))
								}
							}
						}
					}
				}
			}
		}
	}
}

func countLines(t *testing.T, path string) int {
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	n := 0
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<24)
	for sc.Scan() {
		n++
	}
	if err := sc.Err(); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return n
}

func TestFileLengths(t *testing.T) {
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, path)
		if d.IsDir() {
			if name := d.Name(); rel != "." && (strings.HasPrefix(name, ".") || name == "testdata" || name == "build" || name == "node_modules" || name == "__pycache__") {
				return filepath.SkipDir
			}
			return nil
		}
		check := false
		switch {
		case strings.HasSuffix(path, ".go"):
			check = !strings.HasSuffix(path, "_test.go")
		case strings.HasSuffix(path, ".py"):
			check = strings.HasPrefix(rel, "python"+string(filepath.Separator)) || strings.HasPrefix(rel, "bench"+string(filepath.Separator))
		}
		if !check {
			return nil
		}
		if n := countLines(t, path); n > MaxFileLines {
			t.Errorf("%s: %d lines, over %d", rel, n, MaxFileLines)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
